"""The one gradient pipeline every front end uses.

For a list of gradients it: filters (``min_size``, ``None``), compensates with the error memory,
compresses, exchanges through a :class:`~tf_sparsify.collectives.Collective`, decompresses,
averages, and returns the updates, the new residuals and whether the step was finite. It holds
no variables: the front end owns the residual variables and writes them.

Non-finite policy: a replica whose accumulated gradient (or, without error feedback, gradient)
has a NaN or Inf marks its payload non-finite, so every replica's averaged update is non-finite
and all of them agree the step is bad (``finite`` is False). Front ends then keep the residuals
as they were (nothing is lost, nothing is poisoned) and hand the update on unchanged, so a
``LossScaleOptimizer`` inside sees the overflow and skips the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.compressors.base import Compressor, check_float, dtype_bytes, serialize
from tf_sparsify.compressors.dense import Identity

SCOPES = ("layer", "global")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One message: the variables it carries, how it is compressed, and whether it has memory."""

    indices: tuple[int, ...]
    shapes: tuple[tf.TensorShape, ...]
    dtype: tf.DType
    compressor: Compressor
    error_feedback: bool

    @property
    def num_elements(self) -> int:
        return sum(s.num_elements() for s in self.shapes)

    @property
    def wire_bytes(self) -> int:
        return self.compressor.wire_bytes(self.num_elements, self.dtype)

    @property
    def dense_bytes(self) -> int:
        return self.num_elements * dtype_bytes(self.dtype)


@dataclasses.dataclass
class StepResult:
    """What one pipeline step produced; lists are aligned with the input gradients."""

    updates: list[tf.Tensor | None]
    residuals: list[tf.Tensor | None]
    finite: tf.Tensor


class GradientPipeline:
    """Plans messages for a list of variables and runs one exchange step.

    Args:
        compressor: the compressor for tensors of at least ``min_size`` entries.
        error_feedback: keep residuals; ``None`` means on for biased compressors.
        scope: ``"layer"`` compresses each tensor alone, ``"global"`` all tensors of one dtype
            flattened together.
        min_size: tensors with fewer entries travel uncompressed, without memory.
    """

    def __init__(
        self,
        compressor: Compressor,
        error_feedback: bool | None = None,
        scope: str = "layer",
        min_size: int = 0,
    ):
        if not isinstance(compressor, Compressor):
            raise ValueError(
                f"`compressor` must be a tf_sparsify Compressor; received compressor={compressor!r}"
            )
        if scope not in SCOPES:
            raise ValueError(f"`scope` must be one of {SCOPES}; received scope={scope!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
            raise ValueError(f"`min_size` must be an integer >= 0; received min_size={min_size!r}")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ValueError(
                "`error_feedback` must be True, False or None; "
                f"received error_feedback={error_feedback!r}"
            )
        self.compressor = compressor
        self.error_feedback = (
            (not compressor.unbiased) if error_feedback is None else error_feedback
        )
        self.scope = scope
        self.min_size = min_size

    # -- planning (static, from shapes) -------------------------------------------------------
    def plan(self, shapes: Sequence[tf.TensorShape], dtypes: Sequence[tf.DType]) -> list[Unit]:
        """The messages of one step for variables of these shapes and dtypes."""
        compressed, dense = [], []
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            check_float("gradient", dtype)
            shape = tf.TensorShape(shape)
            if not shape.is_fully_defined():
                raise ValueError(f"Gradient shapes must be fully defined; received shape={shape}")
            (compressed if shape.num_elements() >= max(self.min_size, 1) else dense).append(i)
        units = [
            Unit((i,), (tf.TensorShape(shapes[i]),), tf.as_dtype(dtypes[i]), Identity(), False)
            for i in dense
        ]
        groups = [[i] for i in compressed]
        if self.scope == "global":
            by_dtype: dict[tf.DType, list[int]] = {}
            for i in compressed:
                by_dtype.setdefault(tf.as_dtype(dtypes[i]), []).append(i)
            groups = list(by_dtype.values())
        for group in groups:
            units.append(
                Unit(
                    tuple(group),
                    tuple(tf.TensorShape(shapes[i]) for i in group),
                    tf.as_dtype(dtypes[group[0]]),
                    self.compressor,
                    self.error_feedback,
                )
            )
        return sorted(units, key=lambda u: u.indices[0])

    def needs_residual(self, units: Sequence[Unit], num_variables: int) -> list[bool]:
        """Which variables need a residual buffer."""
        flags = [False] * num_variables
        for unit in units:
            for i in unit.indices:
                flags[i] = unit.error_feedback
        return flags

    # -- one step ---------------------------------------------------------------------------
    def step(
        self,
        units: Sequence[Unit],
        grads: Sequence[tf.Tensor | None],
        residuals: Sequence[tf.Tensor | None],
        step: tf.Tensor,
        collective: Collective,
    ) -> StepResult:
        """Exchange ``grads`` (aligned with the planned variables) and return the updates.

        Units whose gradients are ``None`` are skipped (the variables keep their values).
        """
        replica_id = collective.replica_id()
        active = [u for u in units if all(grads[i] is not None for i in u.indices)]
        messages, local_ok = [], []
        for unit in active:
            g = _join([_dense(grads[i]) for i in unit.indices], unit.shapes)
            tensor_id = unit.indices[0]
            if unit.error_feedback:
                e = _join([residuals[i] for i in unit.indices], unit.shapes)
                payload, ctx, remainder = unit.compressor.compress_with_feedback(
                    g, e, step, tensor_id, replica_id
                )
                local_ok += [_all_finite(remainder)] + [_all_finite(t) for t in _floats(payload)]
            else:
                payload, ctx = unit.compressor.compress(g, step, tensor_id, replica_id)
                remainder = None
                if not isinstance(unit.compressor, Identity):
                    local_ok.append(_all_finite(g))
            messages.append((unit, payload, ctx, remainder))

        if local_ok:
            ok = tf.reduce_all(tf.stack(local_ok))
            poison = tf.where(ok, 0.0, float("nan"))
            messages = [(u, _mark(p, poison), c, r) for u, p, c, r in messages]

        summed = collective.all_reduce_sum(
            [t for u, p, _, _ in messages if u.compressor.summable for t in p]
        )
        gathered = collective.all_gather(
            [t for u, p, _, _ in messages if not u.compressor.summable for t in p]
        )

        summed, gathered = iter(summed), iter(gathered)
        updates: list[tf.Tensor | None] = [None] * len(grads)
        new_residuals: list[tf.Tensor | None] = [None] * len(grads)
        finite = []
        for unit, payload, ctx, remainder in messages:
            source = summed if unit.compressor.summable else gathered
            received = tuple(next(source) for _ in payload)
            if unit.compressor.summable:
                total = unit.compressor.decompress(received, ctx)
            else:
                total = unit.compressor.decompress_sum(received, ctx, collective.num_replicas)
            if collective.divisor != 1:
                total = total * tf.cast(1.0 / collective.divisor, total.dtype)
            finite.append(_all_finite(total))
            for i, part in zip(unit.indices, _split(total, unit.shapes), strict=True):
                updates[i] = part
            if remainder is not None:
                for i, part in zip(unit.indices, _split(remainder, unit.shapes), strict=True):
                    new_residuals[i] = part
        all_finite = tf.reduce_all(tf.stack(finite)) if finite else tf.constant(True)
        return StepResult(updates, new_residuals, all_finite)

    def get_config(self) -> dict:
        return {
            "compressor": serialize(self.compressor),
            "error_feedback": self.error_feedback,
            "scope": self.scope,
            "min_size": self.min_size,
        }


def bytes_per_step(units: Sequence[Unit]) -> tuple[int, int]:
    """``(wire bytes, dense bytes)`` one replica sends per step for these messages."""
    return sum(u.wire_bytes for u in units), sum(u.dense_bytes for u in units)


def _dense(grad) -> tf.Tensor:
    """IndexedSlices (Embedding gradients) become dense: the residual is dense anyway."""
    return tf.convert_to_tensor(grad)


def _join(tensors: list[tf.Tensor], shapes: tuple[tf.TensorShape, ...]) -> tf.Tensor:
    """One tensor as it is, several flattened and concatenated."""
    if len(tensors) == 1:
        return tensors[0]
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _split(tensor: tf.Tensor, shapes: tuple[tf.TensorShape, ...]) -> list[tf.Tensor]:
    """Inverse of :func:`_join`."""
    if len(shapes) == 1:
        return [tensor]
    parts = tf.split(tensor, [s.num_elements() for s in shapes])
    return [tf.reshape(p, s) for p, s in zip(parts, shapes, strict=True)]


def _floats(payload) -> list[tf.Tensor]:
    return [t for t in payload if t.dtype.is_floating]


def _all_finite(t: tf.Tensor) -> tf.Tensor:
    return tf.reduce_all(tf.math.is_finite(t))


def _mark(payload, poison: tf.Tensor):
    """Add ``poison`` (0 or NaN) to every float tensor of the payload."""
    return tuple(t + tf.cast(poison, t.dtype) if t.dtype.is_floating else t for t in payload)
