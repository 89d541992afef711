"""Dense compressors whose payloads can be summed: Identity and half-precision casts."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.common.dtypes import dtype_bytes
from tf_sparsify.compressors.base import Codec, Context, Payload
from tf_sparsify.ops.pure_tf import saturating_cast

__all__ = ["BF16", "FP16", "Identity", "saturating_cast"]


class Identity(Codec):
    """No compression: the payload is the tensor itself."""

    travels_as_rows = True

    unbiased = True
    summable = True
    is_identity = True
    reveals_non_finite = True

    def entries_sent(self, num_elements: int) -> int:
        return num_elements

    needs_static_shape = False

    def variance_bound(self, num_elements: int) -> float:
        return 0.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return num_elements * dtype_bytes(dtype)

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        return (tensor,)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        return payload[0]


class _Cast(Codec):
    """Round to a 16-bit float for the wire; biased (round to nearest), summable.

    Finite values beyond the wire type's range saturate to its largest finite value instead of
    becoming Inf (with error feedback, the default, the excess stays in the residual); Inf and
    NaN pass as they are. Tensors already 16-bit travel as they are. float32 tensors are cast,
    with their error feedback, in one pass (:func:`tf_sparsify.ops.saturating_cast_feedback`).
    """

    fuses_feedback = True

    unbiased = False
    summable = True
    reveals_non_finite = True  # NaN and Inf are cast as they are; finite values saturate
    needs_static_shape = False
    wire_dtype: tf.DType
    #: ``u``: round to nearest errs by at most ``u |x|`` inside the wire type's normal range
    unit_roundoff: float

    def contraction(self, num_elements: int) -> float:
        """``1 - u**2``, for entries that are 0 or inside the wire type's normal range.

        Outside it no relative bound holds, but the error stays bounded for error feedback:
        an entry below the normal range errs by at most half the smallest subnormal (it may
        round to 0), and a saturated entry's excess waits in the residual for later steps.
        """
        return 1.0 - self.unit_roundoff**2 if num_elements else 1.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return num_elements * min(self.wire_dtype.size, dtype_bytes(dtype))

    def compress_compensated(self, tensor, residual, step=None, tensor_id=0, replica_id=0):
        """``(payload, ctx, acc - decompress(payload))`` for ``acc = tensor + residual``, the
        cast and its error in one pass."""
        tensor, ctx = self._context(tensor, step, tensor_id)
        if tensor.dtype.size <= self.wire_dtype.size:
            acc = tensor + residual
            return (acc,), ctx, acc - self._decompress((acc,), ctx)
        wire, remainder = ops.saturating_cast_feedback(tensor, residual, self.wire_dtype)
        return (wire,), ctx, remainder

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        if tensor.dtype.size <= self.wire_dtype.size:
            return (tensor,)
        return (ops.saturating_cast_feedback(tensor, None, self.wire_dtype)[0],)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        return tf.cast(payload[0], ctx.dtype)

    def decompress_scaled(self, summed, ctx, divisor):
        """float32 from a 16-bit wire: the division and the finiteness check in the same pass
        (:func:`tf_sparsify.ops.wire_to_float`); the pipeline then checks a scalar, NaN when
        the wire was not finite."""
        wire = summed[0]
        if ctx.dtype != tf.float32 or wire.dtype == ctx.dtype:
            return super().decompress_scaled(summed, ctx, divisor)
        update, finite = ops.wire_to_float(wire, 1.0 / divisor)
        return update, (tf.where(finite, 0.0, float("nan")),)


class FP16(_Cast):
    """Send float16 (10-bit mantissa: ``u = 2**-11``; largest finite value 65504)."""

    travels_as_rows = True

    wire_dtype = tf.float16
    unit_roundoff = 2.0**-11


class BF16(_Cast):
    """Send bfloat16 (7-bit mantissa: ``u = 2**-8``; largest finite value about 3.39e38)."""

    travels_as_rows = True

    wire_dtype = tf.bfloat16
    unit_roundoff = 2.0**-8
