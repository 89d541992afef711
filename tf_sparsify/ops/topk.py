"""TopK with error feedback: one tensor (:func:`topk_error_feedback`), or several of one dtype
in one op (:func:`topk_error_feedback_packed`)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import invalid_argument
from tf_sparsify.ops import dispatch, pure_tf
from tf_sparsify.ops.arguments import check_float, check_index_dtype, check_residual, int_or_scalar

#: the GPU kernel's largest tensor (its counts are int32)
GPU_MAX_ELEMENTS = 2**31 - 1


def check_k(k: Any, n: int | None) -> int | tf.Tensor:
    """``k`` as a checked Python int, or an int32/int64 scalar tensor (checked by the kernel)."""
    k = int_or_scalar("k", k)
    if isinstance(k, int) and (k < 0 or (n is not None and k > n)):
        bound = f"[0, {n}] (the number of elements of grad)" if n is not None else ">= 0"
        raise invalid_argument(f"k must be in {bound}, got k = {k}")
    return k


def topk_error_feedback(
    grad: tf.Tensor,
    residual: tf.Tensor,
    k: int | tf.Tensor,
    index_dtype: tf.DType | None = None,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Fused top-k with error feedback: ``(values, indices, new_residual)``.

    ``acc = grad + residual`` in the input dtype (denormals flushed, see
    :mod:`tf_sparsify.ops.pure_tf`); the k entries of largest magnitude, ranked by the IEEE bit
    pattern with the sign cleared, are selected: NaN ranks above +Inf (so NaNs are always sent
    and never kept in the residual), +0.0 equals -0.0, ties go to the lowest flat index.
    ``indices`` are ascending flat indices, ``values = acc[indices]``, ``new_residual`` is
    ``acc`` with those entries zeroed.

    ``k`` is an int (or an int32/int64 scalar tensor) in ``[0, n]``. ``index_dtype`` defaults to
    int32, or int64 when the static size is ``2**31`` elements or more; with an unknown static
    size and int32 indices, a tensor that turns out that large fails with InvalidArgumentError
    (pass ``index_dtype=tf.int64``). The GPU kernel takes fewer than ``2**31`` elements: larger
    tensors of known size run on the CPU kernel, unknown-size ones fail on GPU saying so.
    """
    grad = tf.convert_to_tensor(grad)
    residual = tf.convert_to_tensor(residual)
    check_float("grad", grad.dtype)
    check_residual(grad, residual)
    n = grad.shape.num_elements()
    k = check_k(k, n)
    index_type = check_index_dtype(index_dtype, n)

    def kernel(ops: Any) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        if n is not None and n > GPU_MAX_ELEMENTS:
            with tf.device("/device:CPU:0"):
                return tuple(ops.top_k_error_feedback(grad, residual, k, index_type=index_type))
        return tuple(ops.top_k_error_feedback(grad, residual, k, index_type=index_type))

    return dispatch.run(kernel, lambda: pure_tf.topk_error_feedback(grad, residual, k, index_type))


def topk_error_feedback_packed(
    grads: list[tf.Tensor], residuals: list[tf.Tensor], ks: list[int]
) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
    """:func:`topk_error_feedback` of several tensors of one dtype in one op, tensor ``i``
    with its own ``ks[i]``: ``(values, indices, new_residuals)``, the values and the indices
    (flat within their own tensor) of the tensors concatenated in order; the same bits as one
    op per tensor. Shapes must be static; indices are int32, int64 when a tensor has ``2**31``
    elements or more."""
    grads = [tf.convert_to_tensor(g) for g in grads]
    residuals = [tf.convert_to_tensor(r) for r in residuals]
    if not grads or len(residuals) != len(grads) or len(ks) != len(grads):
        raise invalid_argument(
            f"need as many residuals and ks as grads (at least one); got {len(grads)} grads, "
            f"{len(residuals)} residuals, {len(ks)} ks"
        )
    sizes = []
    for i, (g, r) in enumerate(zip(grads, residuals, strict=True)):
        check_float(f"grads[{i}]", g.dtype)
        if g.dtype != grads[0].dtype or r.dtype != g.dtype:
            raise invalid_argument(
                f"grads and residuals must share one dtype ({grads[0].dtype.name}); "
                f"grads[{i}] is {g.dtype.name}, residuals[{i}] is {r.dtype.name}"
            )
        if not g.shape.is_fully_defined() or g.shape != r.shape:
            raise invalid_argument(
                f"residuals[{i}] must have grads[{i}]'s static shape {g.shape}, got {r.shape}"
            )
        sizes.append(g.shape.num_elements())
    ks = [check_k(k, n) for k, n in zip(ks, sizes, strict=True)]
    index_type = pure_tf.index_dtype(max(sizes))

    def kernel(ops: Any) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
        values, indices, new_residuals = ops.top_k_error_feedback_packed(
            grads, residuals, ks=ks, index_type=index_type
        )
        return values, indices, list(new_residuals)

    def reference() -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
        parts = [
            pure_tf.topk_error_feedback(g, r, k, index_type)
            for g, r, k in zip(grads, residuals, ks, strict=True)
        ]
        return (
            tf.concat([p[0] for p in parts], 0),
            tf.concat([p[1] for p in parts], 0),
            [p[2] for p in parts],
        )

    return dispatch.run(kernel, reference)
