"""Sparse payloads: the dense sum of values at indices (:func:`scatter_sum`), the Elias-Fano
code of TopK's indices (:func:`encode_indices`, :func:`decode_indices`; layout and pure-TF
reference: :mod:`tf_sparsify.ops.index_code`), their packed forms for several tensors in one
op, and the decoder of gathered packed TopK payloads (:func:`packed_decompress_sum`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import invalid_argument
from tf_sparsify.common.dtypes import INDEX_DTYPES
from tf_sparsify.ops import dispatch, index_code, pure_tf
from tf_sparsify.ops.arguments import (
    MAX_INT64,
    check_float,
    check_index_dtype,
    check_index_type,
    int_in_range,
    int_or_scalar,
)


def _check_vector(name: str, t: tf.Tensor) -> None:
    if t.shape.rank not in (None, 1):
        raise invalid_argument(f"{name} must be a vector, got shape {t.shape}")


def _check_n(n: Any) -> int | tf.Tensor:
    """``n`` as a checked Python int, or an int64 scalar tensor (checked by the kernel)."""
    n = int_or_scalar("n", n)
    if not isinstance(n, int):
        return tf.cast(n, tf.int64)
    if not 0 <= n <= MAX_INT64:
        raise invalid_argument(f"n must be an int in [0, 2**63), got n = {n}")
    return n


def _check_num_elements(num_elements: Any) -> int:
    """``num_elements`` as a Python int in ``[0, 2**63)`` (an int64 attribute)."""
    return int_in_range(
        num_elements,
        0,
        MAX_INT64,
        f"num_elements must be an int in [0, 2**63), got {num_elements!r}",
    )


def scatter_sum(values: tf.Tensor, indices: tf.Tensor, n: int | tf.Tensor) -> tf.Tensor:
    """Dense ``[n]`` tensor: ``dense[j]`` is the sum of the ``values[i]`` with
    ``indices[i] == j``, 0 elsewhere (decompression of sparse payloads in one pass).

    ``values`` is a float vector, ``indices`` an int32/int64 vector of the same length, ``n`` an
    int (or int32/int64 scalar tensor) >= 0. On CPU duplicates add in input order with the
    dtype's addition, as ``tf.math.unsorted_segment_sum`` (the reference) does, and an index
    outside ``[0, n)`` is an InvalidArgumentError. The GPU kernel skips such indices, and sums
    three or more values at one index in an unspecified order.
    """
    values = tf.convert_to_tensor(values)
    indices = tf.convert_to_tensor(indices)
    check_float("values", values.dtype)
    check_index_type("indices", indices.dtype)
    _check_vector("values", values)
    _check_vector("indices", indices)
    if not values.shape.is_compatible_with(indices.shape):
        raise invalid_argument(
            f"indices must have the length of values ({values.shape[0]}), got {indices.shape[0]}"
        )
    n = _check_n(n)
    return dispatch.run(
        lambda ops: ops.scatter_sum(values, indices, n),
        lambda: pure_tf.scatter_sum(values, indices, n),
    )


def encode_indices(indices: tf.Tensor, num_elements: int) -> tf.Tensor:
    """The Elias-Fano code of strictly ascending flat ``indices`` (int32/int64, static length
    k) in ``[0, num_elements)``: uint8 of :func:`~tf_sparsify.ops.index_code.index_code_bytes`
    bytes, about ``2 + log2(num_elements / k)`` bits per index (layout:
    :mod:`tf_sparsify.ops.index_code`). The kernel fails on unsorted, repeated or out-of-range
    indices; the pure-TF reference does not check them. CPU kernel only (a few bytes per index
    move to and from a GPU)."""
    indices = tf.convert_to_tensor(indices)
    check_index_type("indices", indices.dtype)
    if indices.shape.rank != 1 or indices.shape[0] is None:
        raise invalid_argument(
            f"indices must be a vector of static length, got shape {indices.shape}"
        )
    n = _check_num_elements(num_elements)
    return dispatch.run(
        lambda ops: ops.index_code_encode(
            indices, num_elements=n, low_bits=index_code.low_bits_for(n, indices.shape[0])
        ),
        lambda: index_code.reference_encode(indices, n),
    )


def decode_indices(
    code: tf.Tensor, num_elements: int, k: int, index_dtype: tf.DType | None = None
) -> tf.Tensor:
    """Inverse of :func:`encode_indices` on the last axis: ``code[..., bytes]`` gives the
    ``[..., k]`` indices in ``index_dtype`` (default as :func:`topk_error_feedback`'s: int32,
    int64 from ``2**31`` elements on; a gathered ``[replicas, bytes]`` stack, also with an
    unknown number of rows, decodes row by row). A row that is not the code of k strictly
    ascending indices below ``num_elements`` (the map holds other than k ones, an index is out
    of range or not above the one before, a padding bit is set) fails with InvalidArgumentError
    naming the row, in the kernel and in the pure-TF reference (except under XLA, where no op
    can fail)."""
    code = tf.convert_to_tensor(code)
    n = _check_num_elements(num_elements)
    k_int = int_in_range(
        k, 0, n, f"need ints 0 <= k <= num_elements, got k={k!r}, {num_elements=!r}"
    )
    size = index_code.index_code_bytes(n, k_int)
    if code.dtype != tf.uint8 or code.shape.rank in (None, 0) or code.shape[-1] != size:
        raise invalid_argument(
            f"code must be uint8 with {size} bytes on its last axis (k={k_int} of {n} "
            f"indices); got dtype={code.dtype.name}, shape={code.shape}"
        )
    index_dtype = check_index_dtype(index_dtype, n)
    return dispatch.run(
        lambda ops: ops.index_code_decode(
            code,
            num_elements=n,
            k=k_int,
            low_bits=index_code.low_bits_for(n, k_int),
            index_type=index_dtype,
        ),
        lambda: index_code.reference_decode(code, n, k_int, index_dtype),
    )


def _packed_attributes(sizes: Sequence[tuple[int, int]]) -> dict[str, list[int]]:
    """The packed index-code kernels' attributes for segments of ``(n, k)`` ``sizes``."""
    return {
        "num_elements": [n for n, _ in sizes],
        "ks": [k for _, k in sizes],
        "low_bits": [index_code.low_bits_for(n, k) for n, k in sizes],
    }


def encode_indices_packed(indices: tf.Tensor, sizes: list[tuple[int, int]]) -> tf.Tensor:
    """:func:`encode_indices` of consecutive segments of ``indices``, segment ``i`` holding
    ``k`` ascending indices below ``n`` for ``(n, k) = sizes[i]``; the codes concatenated."""
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in INDEX_DTYPES or indices.shape.rank != 1:
        raise invalid_argument(
            f"indices must be an int32/int64 vector, got {indices.dtype.name} "
            f"of shape {indices.shape}"
        )

    def reference() -> tf.Tensor:
        parts = tf.split(indices, [k for _, k in sizes]) if sizes else []
        return tf.concat(
            [index_code.reference_encode(p, n) for p, (n, _) in zip(parts, sizes, strict=True)],
            0,
        )

    return dispatch.run(
        lambda ops: ops.index_code_encode_packed(indices, **_packed_attributes(sizes)),
        reference,
    )


def decode_indices_packed(code: tf.Tensor, sizes: list[tuple[int, int]]) -> tf.Tensor:
    """Inverse of :func:`encode_indices_packed`, row by row: ``code [replicas, bytes]`` gives
    the ``[replicas, sum(k)]`` indices, each segment's flat within its own tensor (int32, int64
    when a segment has ``2**31`` elements or more)."""
    code = tf.convert_to_tensor(code)
    index_type = pure_tf.index_dtype(max((n for n, _ in sizes), default=0))

    def reference() -> tf.Tensor:
        code_bytes = [index_code.index_code_bytes(n, k) for n, k in sizes]
        parts = tf.split(code, code_bytes, axis=1)
        return tf.concat(
            [decode_indices(c, n, k, index_type) for c, (n, k) in zip(parts, sizes, strict=True)],
            1,
        )

    return dispatch.run(
        lambda ops: ops.index_code_decode_packed(
            code, index_type=index_type, **_packed_attributes(sizes)
        ),
        reference,
    )


def _check_shapes_and_ks(
    shapes: Sequence[Any], ks: Sequence[Any]
) -> tuple[list[tf.TensorShape], list[int]]:
    """``shapes`` as fully defined TensorShapes and ``ks`` as ints, one per shape, each in
    ``[0, elements of its shape]``."""
    if len(ks) != len(shapes):
        raise invalid_argument(
            f"ks must have one k per shape (len(shapes) = {len(shapes)}), got len(ks) = "
            f"{len(ks)}: ks = {ks}"
        )
    shapes = [tf.TensorShape(s) for s in shapes]
    checked = []
    for i, (shape, k) in enumerate(zip(shapes, ks, strict=True)):
        if not shape.is_fully_defined():
            raise invalid_argument(f"shapes[{i}] must be fully defined, got {shape}")
        n = shape.num_elements()
        message = f"ks[{i}] must be an int in [0, {n}] (shapes[{i}] = {shape}), got {k!r}"
        checked.append(int_in_range(k, 0, n, message))
    return shapes, checked


def packed_decompress_sum(
    values: tf.Tensor,
    code: tf.Tensor,
    shapes: list[tf.TensorShape],
    ks: list[int],
    scale: float,
) -> list[tf.Tensor]:
    """The dense sums of gathered packed TopK payloads (``values [replicas, sum(ks)]``,
    ``code [replicas, bytes]`` from :func:`encode_indices_packed`), one tensor of each of
    ``shapes``, times ``scale`` (rounded once to the values' dtype): the same bits as decoding
    each segment, :func:`scatter_sum` of its rows and multiplying by ``scale``."""
    values = tf.convert_to_tensor(values)
    code = tf.convert_to_tensor(code)
    check_float("values", values.dtype)
    shapes, ks = _check_shapes_and_ks(shapes, ks)
    if values.shape.rank is not None and (
        values.shape.rank != 2 or values.shape[1] not in (None, sum(ks))
    ):
        raise invalid_argument(
            f"values must be [replicas, sum(ks) = {sum(ks)}], got {values.shape}"
        )
    ns = [s.num_elements() for s in shapes]
    scale_t = tf.constant(scale, values.dtype)

    def reference() -> list[tf.Tensor]:
        code_bytes = [index_code.index_code_bytes(n, k) for n, k in zip(ns, ks, strict=True)]
        value_parts = tf.split(values, ks, axis=1)
        code_parts = tf.split(code, code_bytes, axis=1)
        out = []
        for v, c, n, k, shape in zip(value_parts, code_parts, ns, ks, shapes, strict=True):
            idx = decode_indices(c, n, k)
            dense = pure_tf.scatter_sum(tf.reshape(v, [-1]), tf.reshape(idx, [-1]), n)
            out.append(tf.reshape(dense * scale_t if scale != 1 else dense, shape))
        return out

    def kernel(ops: Any) -> list[tf.Tensor]:
        low_bits = [index_code.low_bits_for(n, k) for n, k in zip(ns, ks, strict=True)]
        return list(
            ops.packed_decompress_sum(
                values, code, scale_t, N=len(shapes), shapes=shapes, ks=ks, low_bits=low_bits
            )
        )

    return dispatch.run(kernel, reference)
