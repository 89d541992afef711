"""TopK sparsification: keep the k entries of largest magnitude (biased; use error feedback)."""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.base import (
    Codec,
    Context,
    Payload,
    check_ratio,
    k_for,
    ones_at,
)
from tf_sparsify.compressors.dense import saturating_cast
from tf_sparsify.ops.index_code import index_code_bytes

VALUE_DTYPES = ("float16", "bfloat16")


class TopK(Codec):
    """Exact top-k by magnitude, ties to the lowest index.

    Give exactly one of ``ratio`` (k = max(1, ceil(ratio * d)), exact in the ratio's decimal
    value: 0.07 keeps 7 of 100) or ``k``; a ``k`` larger than a tensor is clamped to its size.
    Payload: ``(values, code)``: the k values in ascending index order, and the indices as a
    uint8 Elias-Fano code
    (:func:`~tf_sparsify.ops.encode_indices`, about ``2 + log2(d / k)`` bits
    each; its size depends on d and k only). Backed by the fused ``TopKErrorFeedback`` op.

    ``value_dtype``: ``None`` sends values in the tensor's dtype; ``"float16"`` or
    ``"bfloat16"`` rounds them to it (finite values beyond its range saturate to its largest
    finite value, Inf and NaN pass). Tensors no wider than it travel as they are. With error
    feedback the rounding error and any saturated excess stay in the residual, so nothing is
    lost: ``float(sent) + residual == acc`` exactly at every sent entry, except below the
    smallest normal number of the tensor's dtype (float32: 2**-126, about 1.18e-38; float64:
    2**-1022). There denormals are flushed to zero, keeping the sign, as TensorFlow's CPU
    kernels and the fused op do (see :mod:`tf_sparsify.ops`): an entry of ``acc`` below it
    counts as zero, and so does a rounding error below it (``acc`` = -1.3011386e-38 sends
    bfloat16's -1.30406e-38 and keeps 0, losing 2.9e-41), on every device alike.
    """

    travels_as_rows = True
    packs_in_buckets = True

    unbiased = False
    summable = False
    reveals_non_finite = True  # NaN and Inf rank above every finite value: they are sent
    sends_entries = True
    fuses_feedback = True

    def __init__(
        self,
        ratio: float | None = None,
        k: int | None = None,
        value_dtype: str | tf.DType | None = None,
    ):
        if (ratio is None) == (k is None):
            raise ValueError(
                f"TopK needs exactly one of `ratio` or `k`; received ratio={ratio!r}, k={k!r}"
            )
        self.ratio = None if ratio is None else check_ratio(ratio)
        self.k = None if k is None else check_int("k", k)
        self.value_dtype = _check_value_dtype(value_dtype)

    def num_selected(self, num_elements: int) -> int:
        return k_for(num_elements, self.ratio, self.k)

    def entries_sent(self, num_elements: int) -> int:
        return self.num_selected(num_elements)

    def sent_mask(self, payload: Payload, ctx: Context) -> tf.Tensor:
        """1 at the selected indices (also where the selected value is 0)."""
        return ones_at(self.indices(payload[1], ctx), ctx)

    def contraction(self, num_elements: int) -> float:
        """``k / d``: the k largest entries hold at least that share of ``||x||^2``."""
        return self.num_selected(num_elements) / num_elements if num_elements else 1.0

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        k = self.num_selected(num_elements)
        return k * self.wire_dtype(dtype).size + index_code_bytes(num_elements, k)

    def wire_dtype(self, dtype: tf.DType) -> tf.DType:
        """The dtype the values of a ``dtype`` tensor travel in."""
        dtype = tf.as_dtype(dtype)
        if self.value_dtype is None or dtype.size <= tf.as_dtype(self.value_dtype).size:
            return dtype
        return tf.as_dtype(self.value_dtype)

    def compress_compensated(self, tensor, residual, step=None, tensor_id=0, replica_id=0):
        """Error feedback in one pass (:mod:`tf_sparsify.compressors.error_memory`): the fused op,
        then the
        values' rounding error put back at their indices (O(k))."""
        tensor, ctx = self._context(tensor, step, tensor_id)
        values, indices, new_residual = ops.topk_error_feedback(
            tensor, residual, self.num_selected(ctx.num_elements)
        )
        sent = self._round(values)
        if sent.dtype != values.dtype:
            new_residual = _keep_error(new_residual, indices, values, sent, ctx)
        return (sent, ops.encode_indices(indices, ctx.num_elements)), ctx, new_residual

    def _compress(self, tensor, ctx, replica_id) -> Payload:
        values, indices, _ = ops.topk_error_feedback(
            tensor, tf.zeros_like(tensor), self.num_selected(ctx.num_elements)
        )
        return self._round(values), ops.encode_indices(indices, ctx.num_elements)

    def _round(self, values: tf.Tensor) -> tf.Tensor:
        """``values`` in their wire dtype (saturating)."""
        wire = self.wire_dtype(values.dtype)
        return values if wire == values.dtype else saturating_cast(values, wire)

    def indices(self, code: tf.Tensor, ctx: Context) -> tf.Tensor:
        """The flat indices of a code (``[..., bytes]`` gives ``[..., k]``)."""
        n = ctx.num_elements
        return ops.decode_indices(code, n, self.num_selected(n))

    def _decompress(self, payload: Payload, ctx: Context) -> tf.Tensor:
        values, code = payload
        return _scatter(tf.cast(values, ctx.dtype), self.indices(code, ctx), ctx)

    def decompress_sum(self, gathered: Payload, ctx: Context, num_replicas: int) -> tf.Tensor:
        values, indices = self.gathered_entries(gathered, ctx)
        return _scatter(tf.reshape(values, [-1]), tf.reshape(indices, [-1]), ctx)

    def gathered_entries(self, gathered: Payload, ctx: Context) -> tuple[tf.Tensor, tf.Tensor]:
        values, codes = gathered
        return tf.cast(values, ctx.dtype), self.indices(codes, ctx)

    def get_config(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "k": self.k, "value_dtype": self.value_dtype}


def _scatter(values: tf.Tensor, indices: tf.Tensor, ctx: Context) -> tf.Tensor:
    """Dense tensor of ``ctx``'s shape with ``values`` added at flat ``indices`` (one op)."""
    return tf.reshape(ops.scatter_sum(values, indices, ctx.num_elements), ctx.shape)


def _check_value_dtype(value_dtype: str | tf.DType | None) -> str | None:
    """``None``, ``"float16"`` or ``"bfloat16"`` (a ``tf.DType`` of these becomes its name)."""
    if value_dtype is None:
        return None
    name = value_dtype.name if isinstance(value_dtype, tf.DType) else value_dtype
    if name not in VALUE_DTYPES:
        raise ValueError(
            "`value_dtype` must be None (the tensor's dtype), 'float16' or 'bfloat16'; "
            f"received value_dtype={value_dtype!r}"
        )
    return name


def _keep_error(
    residual: tf.Tensor, indices: tf.Tensor, values: tf.Tensor, sent: tf.Tensor, ctx: Context
) -> tf.Tensor:
    """``residual`` (0 at the sent ``indices``) plus the :func:`rounding_error` there (the
    difference of a value and its rounding is exact in the value's dtype). A ScatterSum and an add:
    TF's scatter ops copy the residual and take ~150 ns per index on CPU (16 ms at 100k indices
    against 6 ms for this)."""
    return residual + _scatter(rounding_error(values, sent), indices, ctx)


def rounding_error(values: tf.Tensor, sent: tf.Tensor) -> tf.Tensor:
    """What stays of ``values`` sent as ``sent`` (their rounding to the wire dtype): the exact
    difference, 0 where a value is Inf or NaN and where the error is below the dtype's
    smallest normal number (flushed as TF's CPU subtraction does, on every device)."""
    error = values - tf.cast(sent, values.dtype)
    tiny = tf.constant(np.finfo(values.dtype.as_numpy_dtype).tiny, values.dtype)
    return tf.where(tf.abs(error) >= tiny, error, tf.zeros_like(error))  # False for NaN
