"""Plain SGD steps from gathered sparse updates, in place: on one variable
(:func:`sparse_sgd_apply`) or on several of one dtype in one op
(:func:`sparse_sgd_apply_packed`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import invalid_argument
from tf_sparsify.ops import dispatch, pure_tf
from tf_sparsify.ops.arguments import check_float, check_index_type, scalar


def _sgd_variables(variables: Sequence[Any], what: str) -> tuple[list[tf.Tensor], tf.DType]:
    """The resource handles of ``variables`` (at least one, one float dtype) and that dtype."""
    handles = [getattr(v, "handle", None) for v in variables]
    for i, (variable, handle) in enumerate(zip(variables, handles, strict=True)):
        if handle is None or handle.dtype != tf.resource:
            name = what if what == "variable" else f"{what}[{i}]"
            raise invalid_argument(f"{name} must be a resource variable, got {variable!r}")
    if not handles:
        raise invalid_argument(f"{what} must hold at least one variable")
    dtypes = {tf.as_dtype(v.dtype) for v in variables}
    if len(dtypes) != 1:
        raise invalid_argument(f"{what} must share one dtype, got {sorted(d.name for d in dtypes)}")
    dtype = dtypes.pop()
    check_float(what, dtype)
    return handles, dtype


def _sgd_entries(values, indices, scale, learning_rate, dtype: tf.DType) -> tuple:
    """``values`` and ``indices`` checked as ``[rows, k]`` entries for variables of
    ``dtype``, with ``scale`` and ``learning_rate`` as scalars of ``dtype``."""
    values = tf.convert_to_tensor(values)
    indices = tf.convert_to_tensor(indices)
    if values.dtype != dtype:
        raise invalid_argument(
            f"values must have the variable's dtype {dtype.name}, got {values.dtype.name}"
        )
    check_index_type("indices", indices.dtype)
    if values.shape.rank not in (None, 2) or not values.shape.is_compatible_with(indices.shape):
        raise invalid_argument(
            f"values and indices must be [rows, k] of one shape, got {values.shape} and "
            f"{indices.shape}"
        )
    return values, indices, scalar(scale, dtype), scalar(learning_rate, dtype)


def sparse_sgd_apply(
    variable: Any,
    values: tf.Tensor,
    indices: tf.Tensor,
    scale: float | tf.Tensor,
    learning_rate: float | tf.Tensor,
) -> None:
    """Plain SGD steps from gathered sparse updates, in place: row after row,
    ``variable.flat[indices[r, j]] -= (values[r, j] * scale) * learning_rate``.

    ``variable``: a resource variable (``tf.Variable`` or a Keras variable) of a float dtype;
    ``values``: ``[rows, k]`` in its dtype; ``indices``: ``[rows, k]`` int32/int64 flat indices,
    each row strictly ascending; ``scale`` and ``learning_rate``: scalars (cast to the
    variable's dtype). With one row, or rows sharing no index, the result is bit-identical to
    ``variable.assign_sub((scatter_sum(values, indices) * scale) * learning_rate)``, without
    building that dense tensor. The CPU kernel fails on an index out of range or out of order
    before the variable changes; the pure-TF reference leaves the checks to TensorFlow's
    scatter. CPU kernel only.
    """
    (handle,), dtype = _sgd_variables([variable], "variable")
    values, indices, scale, learning_rate = _sgd_entries(
        values, indices, scale, learning_rate, dtype
    )
    dispatch.run(
        lambda ops: ops.sparse_sgd_apply(handle, values, indices, scale, learning_rate),
        lambda: pure_tf.sparse_sgd_apply(variable, values, indices, scale, learning_rate),
    )


def sparse_sgd_apply_packed(
    variables: Sequence[Any],
    values: tf.Tensor,
    indices: tf.Tensor,
    ks: Sequence[int],
    scale: float | tf.Tensor,
    learning_rate: float | tf.Tensor,
) -> None:
    """:func:`sparse_sgd_apply` of several variables of one dtype in one op: ``variables[i]``'s
    entries are the ``ks[i]`` columns of ``values`` and ``indices`` (``[rows, sum(ks)]``) after
    those of the variables before it, its indices flat within it. The same bits as one
    :func:`sparse_sgd_apply` per variable on its columns; the CPU kernel checks every
    variable's indices before any of them changes. CPU kernel only."""
    handles, dtype = _sgd_variables(variables, "variables")
    ks = [int(k) for k in ks]
    if len(ks) != len(handles) or any(k < 0 for k in ks):
        raise invalid_argument(
            f"ks must be {len(handles)} counts >= 0 (one per variable), got {ks}"
        )
    values, indices, scale, learning_rate = _sgd_entries(
        values, indices, scale, learning_rate, dtype
    )
    if values.shape[1] is not None and values.shape[1] != sum(ks):
        raise invalid_argument(f"values must have sum(ks) = {sum(ks)} columns, got {values.shape}")

    def reference() -> None:
        columns = zip(tf.split(values, ks, axis=1), tf.split(indices, ks, axis=1), strict=True)
        for variable, (part_values, part_indices) in zip(variables, columns, strict=True):
            pure_tf.sparse_sgd_apply(variable, part_values, part_indices, scale, learning_rate)

    dispatch.run(
        lambda ops: ops.sparse_sgd_apply_packed(
            handles, values, indices, scale, learning_rate, ks=ks
        ),
        reference,
    )
