"""What one step carries: its flags, the memory it reads, its result."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.compressors.rounds import SparseUpdate

#: a variable's update: dense, in-place entries, or touched rows
Update = tf.Tensor | SparseUpdate | tf.IndexedSlices


class GradientKind(enum.Enum):
    """What a variable's gradient is in a step (transports compare these across ranks)."""

    #: no gradient: the variable is left out of its unit
    ABSENT = "absent"
    DENSE = "dense"
    #: ``tf.IndexedSlices`` (from an embedding), which may travel as rows
    ROWS = "rows"

    @classmethod
    def of(cls, gradient: Any) -> GradientKind:
        if gradient is None:
            return cls.ABSENT
        return cls.ROWS if isinstance(gradient, tf.IndexedSlices) else cls.DENSE


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """How a step runs, besides its inputs.

    ``measure``: the diagnostics flag (a boolean tensor, e.g. every N steps), or ``None`` when
    nothing is measured. ``per_replica``: every payload travels by all-gather and each update
    gets a leading axis of size ``num_replicas`` holding every replica's decompressed
    contribution (divided by the divisor; for delayed updates and IAG). ``sparse_updates``: a
    unit of one variable whose compressor sends entries gets a :class:`SparseUpdate` instead
    of a dense update.
    """

    measure: tf.Tensor | bool | None = None
    per_replica: bool = False
    sparse_updates: bool = False

    @property
    def measured(self) -> bool:
        return self.measure is not None


#: a plain step: nothing measured, the averaged update only
NO_FLAGS = StepFlags()


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What the state core holds for a step, aligned with the planned variables.

    ``residuals``: the residuals' values, or the variables holding them (a unit sent as rows
    reads only its touched rows). ``momenta``: the momentum buffers (``None`` without momentum
    correction). ``states``: each planned unit's compressor state. ``iteration``: the step
    counter, which keys random choices (with the tensor's and replica's ids).
    """

    residuals: Sequence[Any]
    iteration: tf.Tensor | int
    momenta: Sequence[tf.Tensor | None] | None = None
    states: Sequence[tuple[tf.Tensor, ...]] | None = None


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one pipeline step produced; lists are aligned with the input gradients."""

    updates: list[Update | None]
    residuals: list[tf.Tensor | tf.IndexedSlices | None]
    finite: tf.Tensor
    #: new momentum buffers (aligned like ``residuals``) when momentum correction is on.
    momenta: list[tf.Tensor | None] | None = None
    #: ``[len(units), 5]`` float64 rows of :func:`tf_sparsify.core.measurements.unit_stats`
    #: when the step was measured (zeros on steps where the flag was False).
    stats: tf.Tensor | None = None
    #: ``(wire bytes, dense bytes)`` this replica sent in the step (only variables with a
    #: gradient travel).
    sent_bytes: tuple[int | tf.Tensor, int] = (0, 0)
    #: each planned unit's new compressor state (``None`` where none was sent)
    states: list[tuple[tf.Tensor, ...] | None] | None = None
