"""Argument checks: each raises an error that names the argument and the value received.

Every public entry point checks its numbers here, so the same input gets the same message
everywhere. ``error`` picks the exception: ``ValueError`` for Python-side arguments (the
default), ``tf.errors.InvalidArgumentError`` for the ops (:func:`invalid_argument`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tf_sparsify.common.dtypes import FLOAT_DTYPES

#: seeds travel as int64
MAX_SEED = 2**63 - 1

ErrorFactory = Callable[[str], Exception]


def invalid_argument(message: str) -> tf.errors.InvalidArgumentError:
    """The error the ops raise for a bad argument (as TensorFlow's own kernels do)."""
    return tf.errors.InvalidArgumentError(None, None, message)


def is_number(value: Any, kind: type = numbers.Real) -> bool:
    """A Python or NumPy number of ``kind`` (``numbers.Real`` or ``numbers.Integral``), not a
    bool."""
    return isinstance(value, kind) and not isinstance(value, bool | np.bool_)


def check_int(
    name: str,
    value: Any,
    minimum: int = 1,
    maximum: int | None = None,
    error: ErrorFactory = ValueError,
) -> int:
    """An integer in ``[minimum, maximum]`` (Python or NumPy), returned as a Python int."""
    if (
        not is_number(value, numbers.Integral)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise error(f"`{name}` must be an integer {bound}; received {name}={value!r}")
    return int(value)


def check_number(
    name: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    error: ErrorFactory = ValueError,
) -> float:
    """A finite real number in the interval given (``None``: unbounded on that side; an open
    end excludes its bound), returned as a Python float."""
    ok = is_number(value) and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise error(
            f"`{name}` must be a number {_interval(low, high, low_open, high_open)}; "
            f"received {name}={value!r}"
        )
    return float(value)


def check_seed(seed: Any, name: str = "seed") -> int:
    """A non-negative integer seed that fits int64."""
    return check_int(name, seed, minimum=0, maximum=MAX_SEED)


def check_float_dtype(name: str, dtype: tf.DType, error: ErrorFactory = ValueError) -> None:
    """An error unless ``dtype`` is a floating type we compress (:data:`FLOAT_DTYPES`)."""
    if tf.as_dtype(dtype) not in FLOAT_DTYPES:
        raise error(
            f"`{name}` must be a floating-point tensor (float16, bfloat16, float32, float64); "
            f"received dtype={tf.as_dtype(dtype).name}"
        )


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is None and high is None:
        return "(finite)"
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
