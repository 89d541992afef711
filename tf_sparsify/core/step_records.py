"""Records a step writes every ``every`` steps: a row of numbers per planned unit, averaged over
the replicas when read, and the number of steps done when it was written.

Two use it: the diagnostics (:mod:`~tf_sparsify.core.measurements`, five statistics the routes
compute; a measured step takes the per-unit routes) and the gradient norms (``||g||^2`` of each
unit's fresh gradient as the exchange receives it, computed beside the routes, which then run
as on any other step; what ``Auto``'s accuracy guard reads).
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.common.checks import check_int
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.state_kinds import StateKind

#: the state's records, by the key of their values
DIAGNOSTICS, GRAD_SQ_NORMS = "diagnostics", "grad_sq_norms"


def step_key(key: str) -> str:
    """The key of a record's step counter."""
    return f"{key}_step"


#: every record's keys: a record, not training state, restored when both sides have it
RECORD_KEYS = tuple(k for key in (DIAGNOSTICS, GRAD_SQ_NORMS) for k in (key, step_key(key)))


class StepRecord:
    """``values`` (``[units, width]`` float64, the mean over replicas when read) and ``step``
    (steps done when last written; 0: never), both made by :meth:`build` while ``every`` > 0."""

    def __init__(self, key: str, width: int):
        self.key = key
        self.width = width
        self.every = 0
        self.values: tf.Variable | None = None
        self.step: tf.Variable | None = None

    @property
    def built(self) -> bool:
        return self.values is not None

    def enable(self, name: str, every: int) -> None:
        """Write every ``every`` steps (0: never); ``name`` is the argument in errors."""
        self.every = check_int(name, every, minimum=0)

    def build(self, new_variable, units: int) -> None:
        """Make the variables, once, when enabled (``new_variable`` as the state's)."""
        if self.every and not self.built:
            kind = StateKind.PER_REPLICA_MEAN
            self.values = new_variable(self.key, (units, self.width), tf.float64, kind)
            self.step = new_variable(step_key(self.key), (), tf.int64, StateKind.SHARED)

    def due(self, step: tf.Tensor) -> tf.Tensor | None:
        """Whether the step counted by ``step`` (steps done before it) writes; None when not
        built or turned off."""
        return tf.equal(step % self.every, 0) if self.built and self.every else None

    def write(self, due: tf.Tensor | None, rows: tf.Tensor | None, step: tf.Tensor) -> None:
        """``rows`` and ``step + 1`` where ``due`` (nothing when ``due`` is None)."""
        if due is None:
            return
        self.values.assign(tf.where(due, rows, tf.convert_to_tensor(self.values)))
        done = tf.cast(step + 1, tf.int64)
        self.step.assign(tf.where(due, done, tf.convert_to_tensor(self.step)))


def grad_sq_norms(units: Sequence[Unit], grads: Sequence, due: tf.Tensor) -> tf.Tensor:
    """``[len(units), 1]``: the squared norm of each unit's gradients (a sparse gradient's
    values; 0 for variables without one), summed in float32 as the diagnostics' ``grad_sq``,
    as float64; computed only when ``due``."""

    def sq(grad) -> tf.Tensor:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        return tf.reduce_sum(tf.square(tf.cast(values, tf.float32)))

    def unit_sq(unit: Unit) -> tf.Tensor:
        parts = [sq(grads[i]) for i in unit.indices if grads[i] is not None]
        return tf.cast(tf.add_n(parts), tf.float64) if parts else tf.constant(0.0, tf.float64)

    def compute() -> tf.Tensor:
        return tf.reshape(tf.stack([unit_sq(u) for u in units]), [len(units), 1])

    zeros = tf.zeros([len(units), 1], tf.float64)
    return tf.cond(due, compute, lambda: zeros) if units else zeros
