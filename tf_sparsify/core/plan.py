"""The plan of a step: which variables travel together (:class:`Unit`), how, and in which
bucket. Static: it depends on the variables' shapes and dtypes and on the options only.

Buckets: units travel in buckets of about ``bucket_bytes`` of dense gradient, in backprop
order (the last variables' gradients are ready first). A bucket's compression and exchange
depend only on its own gradients, so the collectives of late layers can run while earlier
gradients are still being computed (``scope="global"`` makes one unit of all gradients of a
dtype: it cannot overlap).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.common.checks import check_float_dtype
from tf_sparsify.common.dtypes import dtype_bytes
from tf_sparsify.compressors.base import Compressor, check_contraction
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.core.options import ExchangeOptions
from tf_sparsify.step_model.buckets import fill_buckets


@dataclasses.dataclass(frozen=True)
class Unit:
    """One message: the variables it carries, how it is compressed, and whether it has memory."""

    indices: tuple[int, ...]
    shapes: tuple[tf.TensorShape, ...]
    dtype: tf.DType
    compressor: Compressor
    error_feedback: bool
    #: the bucket the unit's payload travels in (0 travels first, in backprop order)
    bucket: int = 0
    #: its place among the compressed units, in variable order (what a per-unit compressor's
    #: choice is indexed by); ``None`` for a unit sent dense for its size or rank
    position: int | None = None

    @property
    def num_elements(self) -> int:
        return sum(s.num_elements() for s in self.shapes)

    @property
    def shape(self) -> tf.TensorShape:
        """The shape of the tensor the compressor sees: the variable's, or flat for several."""
        return self.shapes[0] if len(self.shapes) == 1 else tf.TensorShape([self.num_elements])

    @property
    def wire_bytes(self) -> int:
        return self.compressor.wire_bytes_for(self.shape, self.dtype)

    @property
    def dense_bytes(self) -> int:
        return self.num_elements * dtype_bytes(self.dtype)

    def with_gradients(self, grads: Sequence) -> Unit | None:
        """This unit restricted to its variables that have a gradient (``None`` if none has)."""
        present = [j for j, i in enumerate(self.indices) if grads[i] is not None]
        if len(present) == len(self.indices):
            return self
        if not present:
            return None
        return dataclasses.replace(
            self,
            indices=tuple(self.indices[j] for j in present),
            shapes=tuple(self.shapes[j] for j in present),
        )


def plan_units(
    compressor: Compressor,
    options: ExchangeOptions,
    shapes: Sequence[tf.TensorShape],
    dtypes: Sequence[tf.DType],
) -> list[Unit]:
    """The units of one step for variables of these shapes and dtypes, in buckets.

    ValueError when error feedback is on and the compressor does not contract at the size of a
    unit (see :meth:`Compressor.contraction`).
    """
    compressed, dense = [], []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        check_float_dtype("gradient", dtype)
        shape = tf.TensorShape(shape)
        if not shape.is_fully_defined():
            raise ValueError(f"Gradient shapes must be fully defined; received shape={shape}")
        small = shape.num_elements() < max(options.min_size, 1)
        flat = options.skip_1d and shape.rank < 2
        (dense if small or flat else compressed).append(i)
    units = [
        Unit((i,), (tf.TensorShape(shapes[i]),), tf.as_dtype(dtypes[i]), Identity(), False)
        for i in dense
    ]
    groups = [[i] for i in compressed]
    if options.scope == "global":
        by_dtype: dict[tf.DType, list[int]] = {}
        for i in compressed:
            by_dtype.setdefault(tf.as_dtype(dtypes[i]), []).append(i)
        groups = list(by_dtype.values())
    for position, group in enumerate(groups):
        units.append(
            Unit(
                tuple(group),
                tuple(tf.TensorShape(shapes[i]) for i in group),
                tf.as_dtype(dtypes[group[0]]),
                compressor.for_unit(position, len(groups)),
                options.error_feedback,
                position=position,
            )
        )
    for unit in units:  # error feedback needs a contraction at the unit's size
        if unit.error_feedback:
            check_contraction(unit.compressor, unit.num_elements)
    return _in_buckets(units, options.bucket_bytes)


def needs_residual(units: Sequence[Unit], num_variables: int) -> list[bool]:
    """Which variables need a residual buffer."""
    flags = [False] * num_variables
    for unit in units:
        for i in unit.indices:
            flags[i] = unit.error_feedback
    return flags


def needs_momentum(units: Sequence[Unit], num_variables: int, factor: float) -> list[bool]:
    """Which variables need a momentum buffer (all planned ones with momentum correction)."""
    flags = [False] * num_variables
    if factor > 0:
        for unit in units:
            for i in unit.indices:
                flags[i] = True
    return flags


def bytes_per_step(units: Sequence[Unit]) -> tuple[int, int]:
    """``(wire bytes, dense bytes)`` one replica sends per step for these units."""
    return sum(u.wire_bytes for u in units), sum(u.dense_bytes for u in units)


def planned(units: Sequence[Unit], part: Unit) -> Unit:
    """The planned unit that ``part`` (restricted by :meth:`Unit.with_gradients`) came from."""
    return next(u for u in units if part.indices[0] in u.indices)


def _in_buckets(units: list[Unit], bucket_bytes: int) -> list[Unit]:
    """``units`` (in variable order) with buckets assigned in backprop order (the last
    variables' gradients are computed first): as in PyTorch DDP, a bucket is closed once it
    holds ``bucket_bytes`` of dense gradient or more."""
    order = sorted(units, key=lambda u: -max(u.indices))
    buckets = fill_buckets([u.dense_bytes for u in order], bucket_bytes)
    placed = {
        u.indices: dataclasses.replace(u, bucket=b) for u, b in zip(order, buckets, strict=True)
    }
    return [placed[u.indices] for u in sorted(units, key=lambda u: u.indices[0])]
