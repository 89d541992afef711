"""Random-k sparsification, scaled by d/k: an unbiased random quantizer."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.common.checks import check_seed
from tf_sparsify.common.dtypes import dtype_bytes
from tf_sparsify.compressors.base import (
    Codec,
    Context,
    Payload,
    check_ratio,
    k_for,
    ones_at,
    rng_seed,
)
from tf_sparsify.ops import xla


class RandomK(Codec):
    """Keep k of d entries chosen uniformly without replacement, scaled by d/k.

    The indices depend on ``(seed, step, tensor)`` only, never on the replica, so every replica
    picks the same ones: the payload is just the k scaled values, receivers recompute the
    indices, and payloads can be summed by all-reduce. ``variance_bound(d) == d/k - 1``.
    """

    unbiased = True
    summable = True
    randomized = True

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = check_ratio(ratio)
        self.seed = check_seed(seed)

    def num_selected(self, num_elements: int) -> int:
        return k_for(num_elements, self.ratio, None)

    def entries_sent(self, num_elements: int) -> int:
        return self.num_selected(num_elements)

    def sent_mask(self, payload: Payload, ctx: Context) -> tf.Tensor:
        """1 at the step's shared indices."""
        return ones_at(self.indices(ctx.num_elements, ctx.step, ctx.tensor_id), ctx)

    def variance_bound(self, num_elements: int) -> float:
        """``d/k - 1`` (0 if empty); below 1, so contracting, for every d when ``ratio > 1/2``."""
        return num_elements / self.num_selected(num_elements) - 1.0 if num_elements else 0.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return self.num_selected(num_elements) * dtype_bytes(dtype)

    def indices(self, num_elements: int, step, tensor_id: int) -> tf.Tensor:
        """The k shared flat indices for this step and tensor, ascending."""
        # The k largest of d i.i.d. uniform 31-bit keys are a uniform k-subset (ties have
        # probability ~ d^2 / 2^32 and go to the lowest index).
        keys = xla.stateless_uniform_int(
            [num_elements], rng_seed(self.seed, step, tensor_id), maxval=2**31 - 1
        )
        picked = tf.math.top_k(keys, k=self.num_selected(num_elements), sorted=False).indices
        return tf.sort(picked)

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        idx = self.indices(ctx.num_elements, ctx.step, ctx.tensor_id)
        scale = ctx.num_elements / max(self.num_selected(ctx.num_elements), 1)  # 0/1 if empty
        values = tf.gather(tf.reshape(tensor, [-1]), idx) * tf.cast(scale, ctx.dtype)
        return (values,)

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        (values,) = payload
        idx = self.indices(ctx.num_elements, ctx.step, ctx.tensor_id)
        return tf.reshape(ops.scatter_sum(values, idx, ctx.num_elements), ctx.shape)

    def get_config(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "seed": self.seed}
