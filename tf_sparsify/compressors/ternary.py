"""Ternary quantizers: unbiased TernGrad and the biased scaled sign."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import check_seed
from tf_sparsify.compressors import bits
from tf_sparsify.compressors.base import (
    Codec,
    Context,
    Payload,
    rng_seed,
)
from tf_sparsify.ops import xla


class TernGrad(Codec):
    """``Q(v)_i = ||v||_inf * sign(v_i) * Bernoulli(|v_i| / ||v||_inf)``, without clipping.

    Payload: 2-bit codes (4 per byte) and the float32 scale ``||v||_inf``.
    ``variance_bound(d) == sqrt(d) - 1``. Noise keyed by ``(seed, step, tensor, replica)``.
    """

    unbiased = True
    summable = False
    randomized = True
    reveals_non_finite = True  # the scale max|x| is NaN or Inf

    def __init__(self, seed: int = 0):
        self.seed = check_seed(seed)

    def variance_bound(self, num_elements: int) -> float:
        """``sqrt(d) - 1`` (0 for d <= 1): it contracts only for d <= 3."""
        return max(num_elements**0.5 - 1.0, 0.0)

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return bits.packed_size(num_elements, 2) + 4

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        flat = tf.cast(tf.reshape(tensor, [-1]), tf.float32)
        scale = tf.maximum(tf.reduce_max(tf.abs(flat)), 0.0)  # 0 if empty; NaN passes
        safe = tf.where(scale > 0, scale, 1.0)
        u = xla.stateless_uniform(
            [ctx.num_elements], rng_seed(self.seed, ctx.step, ctx.tensor_id, replica_id)
        )
        keep = u < tf.abs(flat) / safe
        code = tf.where(keep, tf.where(flat < 0, 0, 2), 1)  # -1, 0, +1 stored as 0, 1, 2
        return bits.pack(code, 2), scale

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        packed, scale = payload
        code = bits.unpack(packed, 2, ctx.num_elements)
        flat = tf.cast(code - 1, tf.float32) * scale
        return tf.cast(tf.reshape(flat, ctx.shape), ctx.dtype)

    def get_config(self) -> dict[str, Any]:
        return {"seed": self.seed}


class ScaledSign(Codec):
    """``(||x||_1 / d) * sign(x)`` with 1 bit per entry (EF-signSGD); biased.

    Zeros are sent as +1 (one bit has no room for 0); error feedback absorbs the difference.
    Payload: packed sign bits and the float32 scale. The mean is computed in float64 relative
    to ``max|x|``, so it never overflows; only a mean beyond float32's range (float64 input)
    saturates to float32's maximum, the rest staying in the residual.
    """

    unbiased = False
    summable = False
    reveals_non_finite = True  # the scale (mean |x|) is NaN or Inf

    def contraction(self, num_elements: int) -> float:
        """``1/d``: ``||x - C(x)||^2 = ||x||^2 - ||x||_1^2 / d`` and ``||x||_1 >= ||x||``."""
        return 1.0 / num_elements if num_elements else 1.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return bits.packed_size(num_elements, 1) + 4

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        flat = tf.reshape(tensor, [-1])
        return bits.pack(tf.cast(flat >= 0, tf.int32), 1), _mean_abs_float32(flat)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        packed, scale = payload
        sign = tf.cast(bits.unpack(packed, 1, ctx.num_elements), tf.float32) * 2.0 - 1.0
        return tf.cast(tf.reshape(sign * scale, ctx.shape), ctx.dtype)


def _mean_abs_float32(flat: tf.Tensor) -> tf.Tensor:
    """``mean |x|`` as float32 without intermediate overflow (0 if empty; Inf, NaN pass)."""
    wide = tf.abs(tf.cast(flat, tf.float64))
    peak = tf.maximum(tf.reduce_max(wide), 0.0)
    unit = tf.where(tf.math.is_finite(peak) & (peak > 0), peak, 1.0)
    size = tf.cast(tf.maximum(tf.size(wide), 1), tf.float64)
    mean = unit * (tf.reduce_sum(wide / unit) / size)
    biggest = tf.float32.max
    return tf.cast(tf.where(tf.math.is_finite(mean), tf.minimum(mean, biggest), mean), tf.float32)
