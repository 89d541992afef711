"""QSGD: stochastic rounding onto ``levels`` levels of the bucket's L2 norm (unbiased)."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.common.checks import check_int, check_seed
from tf_sparsify.compressors.base import (
    Codec,
    Context,
    Payload,
    rng_seed,
)
from tf_sparsify.ops.pure_tf import level_dtype

MAX_LEVELS = 32767


class QSGD(Codec):
    """Quantize ``|x_i| / ||x_bucket||_2`` onto ``{0, 1/s, ..., 1}`` by unbiased rounding.

    Payload: signed levels (int8 for ``levels <= 127``, int16 up to 32767) and one float32
    norm per bucket. ``bucket_size=None`` uses the whole tensor as one bucket.
    ``variance_bound(d) == min(b/s**2, sqrt(b)/s)`` with ``b = min(d, bucket_size)``.
    The rounding noise is keyed by ``(seed, step, tensor, replica)``: replicas draw
    independently, and the compiled op and the reference give identical payloads.
    """

    unbiased = True
    summable = False
    randomized = True
    reveals_non_finite = True  # a bucket's norm is NaN or Inf

    def __init__(self, levels: int, bucket_size: int | None = None, seed: int = 0):
        self.levels = check_int("levels", levels, maximum=MAX_LEVELS)
        self.bucket_size = None if bucket_size is None else check_int("bucket_size", bucket_size)
        self.seed = check_seed(seed)

    def _bucket(self, num_elements: int) -> int:
        return num_elements if self.bucket_size is None else min(self.bucket_size, num_elements)

    def variance_bound(self, num_elements: int) -> float:
        b, s = self._bucket(num_elements), self.levels
        return min(b / s**2, math.sqrt(b) / s)

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        buckets = -(-num_elements // max(self._bucket(num_elements), 1))
        return num_elements * level_dtype(self.levels).size + 4 * buckets

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        key = tf.random.stateless_uniform(
            [],
            seed=rng_seed(self.seed, ctx.step, ctx.tensor_id, replica_id),
            minval=None,
            maxval=None,
            dtype=tf.int64,
            alg="philox",  # the seed's Philox key as TF's kernels derive it, also under XLA
        )
        return ops.qsgd_quantize(tensor, self.levels, self.bucket_size or 0, key)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        signed_levels, norms = payload
        return ops.qsgd_dequantize(
            signed_levels, norms, self.levels, self.bucket_size or 0, ctx.shape, ctx.dtype
        )

    def get_config(self) -> dict[str, Any]:
        return {"levels": self.levels, "bucket_size": self.bucket_size, "seed": self.seed}
