"""Dense compressors whose payloads can be summed: Identity and half-precision casts."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.compressors.base import Codec, Context, Payload, dtype_bytes


class Identity(Codec):
    """No compression: the payload is the tensor itself."""

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
    NaN pass as they are. Tensors already 16-bit travel as they are.
    """

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

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        if tensor.dtype.size <= self.wire_dtype.size:
            return (tensor,)
        return (saturating_cast(tensor, self.wire_dtype),)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        return tf.cast(payload[0], ctx.dtype)


class FP16(_Cast):
    """Send float16 (10-bit mantissa: ``u = 2**-11``; largest finite value 65504)."""

    wire_dtype = tf.float16
    unit_roundoff = 2.0**-11


class BF16(_Cast):
    """Send bfloat16 (7-bit mantissa: ``u = 2**-8``; largest finite value about 3.39e38)."""

    wire_dtype = tf.bfloat16
    unit_roundoff = 2.0**-8


def saturating_cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``tensor`` rounded to ``dtype``; finite values beyond its range become its largest finite
    value (not Inf), Inf and NaN stay as they are."""
    biggest = dtype.max
    saturated = tf.clip_by_value(tensor, -biggest, biggest)  # NaN stays NaN
    return tf.cast(tf.where(tf.math.is_inf(tensor), tensor, saturated), dtype)
