"""The argument checks that several op families share.

A bad argument raises InvalidArgumentError (:func:`~tf_sparsify.common.checks.invalid_argument`,
as TensorFlow's own kernels do) naming the argument and the value received; the dtype lists are
:mod:`tf_sparsify.common.dtypes`'. The checks run before the choice of kernel or reference, so
both paths refuse the same arguments with the same messages.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import tensorflow as tf

from tf_sparsify.common.checks import invalid_argument, is_number
from tf_sparsify.common.dtypes import FLOAT_DTYPES, INDEX_DTYPES
from tf_sparsify.ops import pure_tf

#: the largest int64, the bound of the ops' int64 attributes
MAX_INT64 = 2**63 - 1


def static_int(value: Any) -> int | None:
    """``value`` as a Python int when it is one (or a NumPy integer, not a bool), else None."""
    return int(value) if is_number(value, numbers.Integral) else None


def int_in_range(value: Any, low: int, high: int, message: str) -> int:
    """``value`` as a Python int in ``[low, high]``; InvalidArgumentError(``message``) unless
    it is such an int."""
    number = static_int(value)
    if number is None or not low <= number <= high:
        raise invalid_argument(message)
    return number


def int_or_scalar(name: str, value: Any) -> int | tf.Tensor:
    """``value`` as a Python int when it is one, else as an int32/int64 scalar tensor (whose
    value the kernel checks); a float, a bool or a string is refused."""
    number = static_int(value)
    if number is not None:
        return number
    if isinstance(value, bool | np.bool_ | float | np.floating | str):
        raise invalid_argument(
            f"{name} must be an integer, got {name} = {value!r} ({type(value).__name__})"
        )
    tensor = tf.convert_to_tensor(value)
    if tensor.dtype not in INDEX_DTYPES:
        raise invalid_argument(
            f"{name} must be an int32 or int64 scalar, got dtype {tensor.dtype.name}"
        )
    if tensor.shape.rank not in (None, 0):
        raise invalid_argument(f"{name} must be a scalar, got shape {tensor.shape}")
    return tensor


def check_float(name: str, dtype: tf.DType) -> None:
    """InvalidArgumentError unless ``dtype`` is one of the ops' float dtypes."""
    if dtype not in FLOAT_DTYPES:
        raise invalid_argument(
            f"{name} must be float16, bfloat16, float32 or float64, got {dtype.name}"
        )


def check_residual(grad: tf.Tensor, residual: tf.Tensor) -> None:
    """InvalidArgumentError unless ``residual`` has ``grad``'s dtype and (compatible) shape."""
    if residual.dtype != grad.dtype:
        raise invalid_argument(
            f"residual must have grad's dtype {grad.dtype.name}, got {residual.dtype.name}"
        )
    if not grad.shape.is_compatible_with(residual.shape):
        raise invalid_argument(
            f"residual must have grad's shape {grad.shape}, got {residual.shape}"
        )


def check_index_type(name: str, dtype: tf.DType) -> None:
    """InvalidArgumentError unless ``dtype`` is int32 or int64."""
    if dtype not in INDEX_DTYPES:
        raise invalid_argument(f"{name} must be int32 or int64, got {dtype.name}")


def check_index_dtype(index_dtype: Any, n: int | None) -> tf.DType:
    """The indices' dtype for ``n`` elements (None: unknown): ``index_dtype`` (int32 or int64;
    int32 only below ``2**31`` elements) or by default :func:`~tf_sparsify.ops.pure_tf.
    index_dtype`'s."""
    if index_dtype is None:
        return pure_tf.index_dtype(n)
    dtype = tf.as_dtype(index_dtype)
    check_index_type("index_dtype", dtype)
    if dtype == tf.int32 and n is not None and n > pure_tf.MAX_INT32_ELEMENTS:
        raise invalid_argument(f"index_dtype int32 cannot index {n} elements; use tf.int64")
    return dtype


def scalar(value: float | tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``value`` in ``dtype``; a Python number is rounded once, to ``dtype`` (``tf.cast`` would
    round it to float32 first)."""
    if isinstance(value, int | float | np.number):
        return tf.constant(value, dtype)
    return tf.cast(value, dtype)
