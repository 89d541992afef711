"""TopK sparsification: keep the k entries of largest magnitude (biased; use error feedback)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.compressors.base import (
    Compressor,
    Context,
    Payload,
    check_positive_int,
    check_ratio,
    dtype_bytes,
    k_for,
    ones_at,
)
from tf_sparsify.ops.reference import index_dtype


class TopK(Compressor):
    """Exact top-k by magnitude, ties to the lowest index.

    Give exactly one of ``ratio`` (k = max(1, ceil(ratio * d))) or ``k``; a ``k`` larger than
    a tensor is clamped to its size. Payload: ``(values, indices)``, indices ascending,
    int32 (int64 for tensors of 2**31 entries or more). Backed by the fused
    ``TopKErrorFeedback`` op when compiled.
    """

    unbiased = False
    summable = False
    reveals_non_finite = True  # NaN and Inf rank above every finite value: they are sent

    def __init__(self, ratio: float | None = None, k: int | None = None):
        if (ratio is None) == (k is None):
            raise ValueError(
                f"TopK needs exactly one of `ratio` or `k`; received ratio={ratio!r}, k={k!r}"
            )
        self.ratio = None if ratio is None else check_ratio(ratio)
        self.k = None if k is None else check_positive_int("k", k)

    def num_selected(self, num_elements: int) -> int:
        return k_for(num_elements, self.ratio, self.k)

    def entries_sent(self, num_elements: int) -> int:
        return self.num_selected(num_elements)

    def sent_mask(self, payload: Payload, ctx: Context) -> tf.Tensor:
        """1 at the selected indices (also where the selected value is 0)."""
        return ones_at(payload[1], ctx)

    def contraction(self, num_elements: int) -> float:
        """``k / d``: the k largest entries hold at least that share of ``||x||^2``."""
        return self.num_selected(num_elements) / num_elements if num_elements else 1.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        k = self.num_selected(num_elements)
        return k * (dtype_bytes(dtype) + index_dtype(num_elements).size)

    def compress_with_feedback(self, tensor, residual, step=None, tensor_id=0, replica_id=0):
        tensor, ctx = self._context(tensor, step, tensor_id)
        values, indices, new_residual = ops.topk_error_feedback(
            tensor, residual, self.num_selected(ctx.num_elements)
        )
        return (values, indices), ctx, new_residual

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        values, indices, _ = ops.topk_error_feedback(
            tensor, tf.zeros_like(tensor), self.num_selected(ctx.num_elements)
        )
        return values, indices

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        values, indices = payload
        return _scatter(values, indices, ctx)

    def decompress_sum(self, gathered: Payload, ctx: Context, num_replicas: int) -> tf.Tensor:
        values, indices = gathered
        return _scatter(tf.reshape(values, [-1]), tf.reshape(indices, [-1]), ctx)

    def get_config(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "k": self.k}


def _scatter(values: tf.Tensor, indices: tf.Tensor, ctx: Context) -> tf.Tensor:
    """Dense tensor of ``ctx``'s shape with ``values`` added at flat ``indices`` (one op)."""
    return tf.reshape(ops.scatter_sum(values, indices, ctx.num_elements), ctx.shape)
