"""The 16-bit wire formats: the cast with error feedback (:func:`saturating_cast_feedback`),
its decoder (:func:`wire_to_float`) and the sum of gathered payloads (:func:`wire_sum`). Their
kernels run on the CPU: tensors on a GPU take the pure-TF reference."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.common.checks import invalid_argument
from tf_sparsify.common.dtypes import WIRE_DTYPES
from tf_sparsify.ops import dispatch, pure_tf
from tf_sparsify.ops.arguments import check_residual, scalar


def _check_wire(name: str, dtype: tf.DType) -> None:
    if dtype not in WIRE_DTYPES:
        raise invalid_argument(f"{name} must be float16 or bfloat16, got {dtype.name}")


def saturating_cast_feedback(
    grad: tf.Tensor,
    residual: tf.Tensor | None,
    wire_dtype: tf.DType,
    portable: bool = False,
) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``(wire, new_residual)`` in one pass: ``v = grad + residual`` (``grad`` alone when
    ``residual`` is None), ``wire`` = ``v`` in ``wire_dtype`` (float16 or bfloat16), rounded to
    nearest even, finite values beyond its range saturated to its largest finite value, Inf
    kept, NaN as ``tf.cast`` gives it; ``new_residual = v - float(wire)`` (None without a
    residual). Denormals: see :mod:`tf_sparsify.ops.pure_tf`.

    ``grad`` and ``residual`` are float32 or float64 of one shape. The CPU kernel takes float32
    (F16C or AVX512-BF16 where the CPU has them; ``portable=True``, for tests, forces its
    portable path, which gives the same bits); float64, tensors on a GPU (or, when the device
    is not known yet, any tensor while TensorFlow sees a GPU) and XLA run the pure-TF
    reference.
    """
    grad = tf.convert_to_tensor(grad)
    if grad.dtype not in (tf.float32, tf.float64):
        raise invalid_argument(f"grad must be float32 or float64, got {grad.dtype.name}")
    wire_dtype = tf.as_dtype(wire_dtype)
    _check_wire("wire_dtype", wire_dtype)
    if residual is not None:
        residual = tf.convert_to_tensor(residual)
        check_residual(grad, residual)

    def kernel(ops) -> tuple[tf.Tensor, tf.Tensor | None]:
        residuals = [] if residual is None else [residual]
        wire, new = ops.saturating_cast_feedback(
            grad, residuals, wire_type=wire_dtype, portable=portable
        )
        return wire, (new[0] if new else None)

    return dispatch.run(
        kernel,
        lambda: pure_tf.saturating_cast_feedback(grad, residual, wire_dtype),
        kernel_takes=grad.dtype == tf.float32 and dispatch.runs_on_cpu(grad),
    )


def wire_to_float(
    wire: tf.Tensor, scale: float | tf.Tensor = 1.0, portable: bool = False
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(float32(wire) * scale, whether every entry of wire is finite)`` in one pass: the
    decoder of :func:`saturating_cast_feedback`'s wire (float16 or bfloat16), with the check
    the pipeline runs on received payloads. Denormal inputs and products flush to zero (see
    :mod:`tf_sparsify.ops.pure_tf`). CPU kernel (``portable`` as in
    :func:`saturating_cast_feedback`); on a GPU and under XLA the pure-TF reference."""
    wire = tf.convert_to_tensor(wire)
    _check_wire("wire", wire.dtype)
    scale = scalar(scale, tf.float32)
    if scale.shape.rank not in (None, 0):
        raise invalid_argument(f"scale must be a scalar, got shape {scale.shape}")
    return dispatch.run(
        lambda ops: tuple(ops.wire_to_float(wire, scale, portable=portable)),
        lambda: pure_tf.wire_to_float(wire, scale),
        kernel_takes=dispatch.runs_on_cpu(wire),
    )


def wire_sum(gathered: tf.Tensor, portable: bool = False) -> tf.Tensor:
    """The sum over the first axis (the ranks) of ``gathered`` ``[P, ...]`` (float16 or
    bfloat16), in its dtype: bit for bit what ``tf.cast(tf.reduce_sum(tf.cast(gathered,
    tf.float32), axis=0), dtype)`` gives on CPU, in one pass. Each entry is added in float32
    from +0.0 in rank order (denormals: see :mod:`tf_sparsify.ops.pure_tf`), then rounded once
    to nearest even, to Inf beyond the dtype's range (no saturation); a NaN sum is 0x7E00
    (float16) or 0x7FC0 (bfloat16), where ``tf.cast`` gives 0x7FC0 or 0xFFC0. With ``P = 1``
    the row itself (NaNs likewise), as ``reduce_sum`` returns it. CPU kernel (``portable`` as
    in :func:`saturating_cast_feedback`); on a GPU and under XLA the pure-TF reference."""
    gathered = tf.convert_to_tensor(gathered)
    _check_wire("gathered", gathered.dtype)
    if gathered.shape.rank == 0:
        raise invalid_argument(
            f"gathered must have rank >= 1 (ranks first), got shape {gathered.shape}"
        )
    return dispatch.run(
        lambda ops: ops.wire_sum(gathered, portable=portable),
        lambda: pure_tf.wire_sum(gathered),
        kernel_takes=dispatch.runs_on_cpu(gathered),
    )
