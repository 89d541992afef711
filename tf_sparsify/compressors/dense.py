"""Dense compressors whose payloads can be summed: Identity and half-precision casts."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.compressors.base import Compressor, Context, Payload, dtype_bytes


class Identity(Compressor):
    """No compression: the payload is the tensor itself."""

    unbiased = True
    summable = True

    def variance_bound(self, num_elements: int) -> float:
        return 0.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return num_elements * dtype_bytes(dtype)

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        return (tensor,)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        return payload[0]


class _Cast(Compressor):
    """Round to a 16-bit float for the wire; biased (round to nearest), summable."""

    unbiased = False
    summable = True
    wire_dtype: tf.DType

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return num_elements * min(self.wire_dtype.size, dtype_bytes(dtype))

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        if tensor.dtype.size <= self.wire_dtype.size:
            return (tensor,)
        return (tf.cast(tensor, self.wire_dtype),)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        return tf.cast(payload[0], ctx.dtype)


class FP16(_Cast):
    """Send float16 (tensors already 16-bit travel as they are)."""

    wire_dtype = tf.float16


class BF16(_Cast):
    """Send bfloat16 (tensors already 16-bit travel as they are)."""

    wire_dtype = tf.bfloat16
