"""The one gradient pipeline every front end uses.

A step offers each planned unit (:mod:`tf_sparsify.core.plan`) with a gradient to the routes
(:mod:`tf_sparsify.core.routes`: sparse rows, packed TopK bucket, dense), in that order; the
first that claims it compresses it and starts its rounds. Bucket by bucket, the rounds are
driven in lockstep through the step's collective (:mod:`tf_sparsify.core.lockstep`); each
route turns its outcome into per-variable updates, residuals and momenta, and, when asked, the
step is measured (:func:`~tf_sparsify.core.measurements.measure_step`). The pipeline holds no
variables: the state core (:class:`~tf_sparsify.core.state.CompressionState`) owns them and
writes them back.

Non-finite policy: a step is finite when every bucket's received payloads are. Compressors
whose payload shows a non-finite input (``reveals_non_finite``: TopK sends NaN and Inf first,
QSGD's norms and the scales become non-finite, casts keep them) need nothing more; others mark
their payload non-finite when what they keep (residual, momentum) would be. So every replica
sees the same payloads and agrees whether the step is bad; the state core then keeps the
residuals as they were (nothing is lost, nothing is poisoned) and the update goes on unchanged,
so a ``LossScaleOptimizer`` inside sees the overflow and skips the step.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.compat import moved_names
from tf_sparsify.compressors.base import Compressor, serialize
from tf_sparsify.compressors.rounds import ReplicaGroup
from tf_sparsify.core import measurements, plan
from tf_sparsify.core.lockstep import exchange_bucket
from tf_sparsify.core.options import ExchangeOptions
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.routes import ROUTES
from tf_sparsify.core.routes.route import Message, Route, StepContext
from tf_sparsify.core.step import NO_FLAGS, StepFlags, StepMemory, StepResult
from tf_sparsify.heuristics import clipping
from tf_sparsify.ops.xla import in_xla_context


class GradientPipeline:
    """Plans messages for a list of variables and runs one exchange step.

    Args:
        compressor: the compressor for tensors that are compressed (see ``options``).
        options: an :class:`~tf_sparsify.core.options.ExchangeOptions`, or its fields as
            keyword arguments (``error_feedback``, ``scope``, ``min_size``, ``skip_1d``,
            ``momentum_correction``, ``local_clipnorm``, ``bucket_bytes``); ``pipeline.options``
            holds them, ``error_feedback`` resolved for the compressor.
    """

    def __init__(
        self, compressor: Compressor, options: ExchangeOptions | None = None, **kwargs: Any
    ):
        if not isinstance(compressor, Compressor):
            raise ValueError(
                f"`compressor` must be a tf_sparsify Compressor; received compressor={compressor!r}"
            )
        if options is None:
            options = ExchangeOptions.take(kwargs)
        elif not isinstance(options, ExchangeOptions):
            raise ValueError(f"`options` must be an ExchangeOptions; received options={options!r}")
        if kwargs:
            raise ValueError(
                f"GradientPipeline got unknown arguments {sorted(kwargs)}; its options are "
                f"{ExchangeOptions.names()}"
            )
        self.compressor = compressor
        self.options = options.for_compressor(compressor)

    def __getattr__(self, name: str) -> Any:
        """``pipeline.<option>``, kept for one release: read ``pipeline.options.<option>``."""
        options = self.__dict__.get("options")
        if options is None or name not in ExchangeOptions.names():
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        warnings.warn(
            f"`GradientPipeline.{name}` is now `GradientPipeline.options.{name}`; the old "
            "attribute will be removed in tf_sparsify 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(options, name)

    def with_compressor(self, compressor: Compressor) -> GradientPipeline:
        """The same pipeline with another compressor (error feedback as resolved here)."""
        return GradientPipeline(compressor, self.options)

    # -- planning (static, from shapes) -------------------------------------------------------
    def plan(self, shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType]) -> list[Unit]:
        """The units of one step for variables of these shapes and dtypes
        (:func:`~tf_sparsify.core.plan.plan_units`)."""
        return plan.plan_units(self.compressor, self.options, shapes, dtypes)

    def needs_momentum(self, units: Sequence[Unit], num_variables: int) -> list[bool]:
        """Which variables need a momentum buffer (all planned ones with momentum correction)."""
        return plan.needs_momentum(units, num_variables, self.options.momentum_correction)

    def needs_residual(self, units: Sequence[Unit], num_variables: int) -> list[bool]:
        """Which variables need a residual buffer."""
        return plan.needs_residual(units, num_variables)

    # -- one step ---------------------------------------------------------------------------
    def run(
        self,
        units: Sequence[Unit],
        grads: Sequence[tf.Tensor | tf.IndexedSlices | None],
        memory: StepMemory,
        collective: Collective,
        flags: StepFlags = NO_FLAGS,
    ) -> StepResult:
        """Exchange ``grads`` (aligned with the planned variables) and return the updates.

        Variables whose gradient is ``None`` are left out of their unit (they keep their
        values, and their residuals and momenta stay as they were); the others travel. With
        ``flags.measure``, ``StepResult.stats`` holds this replica's measurements of the step.
        """
        options = self.options
        if options.momentum_correction > 0 and memory.momenta is None:
            raise ValueError("Momentum correction is on: the step's `momenta` must be given.")
        if not self.compressor.runs_under_xla and in_xla_context():
            raise ValueError(
                f"{self.compressor!r} exchanges sizes that depend on the data, which XLA cannot "
                "compile: compile the Keras model with `jit_compile=False` and do not use "
                "tf.function(jit_compile=True) around the exchange."
            )
        replicas = ReplicaGroup(
            collective.num_replicas, collective.replica_id(), collective.divisor
        )
        if options.local_clipnorm is not None:  # the joint norm needs every gradient dense
            grads = clipping.clip_by_local_norm(
                [None if g is None else tf.convert_to_tensor(g) for g in grads],
                options.local_clipnorm,
                collective.num_replicas,
                collective.divisor,
            )
        step = StepContext(
            grads=list(grads),
            memory=memory,
            replicas=replicas,
            flags=flags,
            momentum_factor=options.momentum_correction,
            gathers_rows=collective.gathers_rows,
            clipped=options.local_clipnorm is not None,
        )
        messages = self._start(units, step)
        buckets: dict[int, list[Message]] = {}
        for message in sorted(messages, key=lambda m: m.unit.indices[0]):
            buckets.setdefault(message.unit.bucket, []).append(message)
        finite = [exchange_bucket(bucket, collective) for bucket in buckets.values()]
        return StepResult(
            updates=_per_variable(messages, len(grads), "updates"),
            residuals=_per_variable(messages, len(grads), "residuals"),
            finite=tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True),
            momenta=_per_variable(messages, len(grads), "momenta")
            if options.momentum_correction > 0
            else None,
            stats=None
            if flags.measure is None
            else measurements.measure_step(
                units, messages, flags.measure, memory.iteration, replicas.replica_id
            ),
            sent_bytes=_sent_bytes(messages),
            states=[
                next(
                    (m.after.compressor_state for m in messages if m.unit.indices == u.indices),
                    None,
                )
                for u in units
            ],
        )

    def run_step(
        self,
        units: Sequence[Unit],
        grads: Sequence[tf.Tensor | None],
        residuals: Sequence[Any],
        iteration: tf.Tensor | int,
        collective: Collective,
        momenta: Sequence[tf.Tensor | None] | None = None,
        measure: tf.Tensor | bool | None = None,
        per_replica: bool = False,
        states: Sequence[tuple[tf.Tensor, ...]] | None = None,
        sparse_updates: bool = False,
    ) -> StepResult:
        """:meth:`run` with the memory and flags as separate arguments, kept for one release."""
        warnings.warn(
            "`GradientPipeline.run_step(...)` is now `GradientPipeline.run(units, grads, "
            "StepMemory(...), collective, StepFlags(...))`; the old method will be removed in "
            "tf_sparsify 0.3.",
            DeprecationWarning,
            stacklevel=2,
        )
        memory = StepMemory(residuals, iteration, momenta, states)
        return self.run(
            units, grads, memory, collective, StepFlags(measure, per_replica, sparse_updates)
        )

    def _start(self, units: Sequence[Unit], step: StepContext) -> list[Message]:
        """Each unit with a gradient, started by the first route that claims it."""
        claimed: dict[Route, list[tuple[int, Unit]]] = {route: [] for route in ROUTES}
        for index, unit in enumerate(units):
            sent = unit.with_gradients(step.grads)
            if sent is not None:
                route = next(r for r in ROUTES if r.claims(sent, step))
                claimed[route].append((index, sent))
        return [m for route, group in claimed.items() if group for m in route.start(group, step)]

    def get_config(self) -> dict:
        return {"compressor": serialize(self.compressor), **self.options.get_config()}


def _per_variable(messages: list[Message], count: int, field: str) -> list:
    """A per-variable list of the messages' ``field`` (``None`` where a variable had none)."""
    out: list = [None] * count
    for m in messages:
        for i, part in zip(m.unit.indices, getattr(m, field), strict=True):
            out[i] = part
    return out


def _sent_bytes(messages: Sequence[Message]) -> tuple[int | tf.Tensor, int]:
    """``(wire bytes, dense bytes)`` this replica sent in a step."""
    sent = [m.route.sent_bytes(m) for m in messages]
    static = sum(b for b in sent if isinstance(b, int))
    measured = [b for b in sent if not isinstance(b, int)]
    dense = plan.bytes_per_step([m.unit for m in messages])[1]
    return (static + tf.add_n(measured) if measured else static), dense


#: names this module had before the core was split (kept one release)
__getattr__ = moved_names(
    __name__,
    {
        "Unit": "tf_sparsify.core.plan",
        "bytes_per_step": "tf_sparsify.core.plan",
        "PackedUnit": "tf_sparsify.core.routes.packed_topk",
        "Message": "tf_sparsify.core.routes.route",
        "StepResult": "tf_sparsify.core.step",
        "SparseUpdate": "tf_sparsify.compressors.rounds",
    },
)
