"""Custom ops: fused TopK with error feedback and QSGD quantization.

Each function runs the compiled kernels of ``lib/_tf_sparsify_ops.so`` (built by
``python -m tf_sparsify.ops.build``) when that library loads, and otherwise the pure-TF
reference in :mod:`tf_sparsify.ops.reference`, which gives identical results, with a one-time
warning. With ``TF_SPARSIFY_REQUIRE_OPS=1`` a missing library raises RuntimeError instead.
Arguments are checked here for both paths; invalid ones raise InvalidArgumentError.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import tensorflow as tf

from tf_sparsify.ops import reference
from tf_sparsify.ops.numpy_reference import num_buckets

__all__ = [
    "LIBRARY_PATH",
    "OpsInfo",
    "info",
    "is_compiled",
    "qsgd_dequantize",
    "qsgd_quantize",
    "topk_error_feedback",
]

LIBRARY_PATH = Path(__file__).resolve().parent / "lib" / "_tf_sparsify_ops.so"
REQUIRE_ENV = "TF_SPARSIFY_REQUIRE_OPS"
OP_NAMES = ("TopKErrorFeedback", "QSGDQuantize", "QSGDDequantize")
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
MAX_LEVELS = 32767

_warned = False


@dataclass(frozen=True)
class _Library:
    module: ModuleType | None
    reason: str | None


@functools.cache
def _library() -> _Library:
    if not LIBRARY_PATH.is_file():
        return _Library(None, f"{LIBRARY_PATH} not found; run `python -m tf_sparsify.ops.build`")
    try:
        module = tf.load_op_library(str(LIBRARY_PATH))
    except (tf.errors.OpError, OSError) as err:
        return _Library(None, f"cannot load {LIBRARY_PATH}: {err}")
    for name in OP_NAMES:
        tf.no_gradient(name)
    return _Library(module, None)


# Load at import so that graphs and SavedModels using the ops can be imported right away.
_library()


def _compiled() -> ModuleType | None:
    """The loaded op module, or None after warning once (error under TF_SPARSIFY_REQUIRE_OPS)."""
    global _warned
    lib = _library()
    if lib.module is not None:
        return lib.module
    if os.environ.get(REQUIRE_ENV) == "1":
        raise RuntimeError(f"{REQUIRE_ENV}=1 but the compiled ops are unavailable: {lib.reason}")
    if not _warned:
        _warned = True
        warnings.warn(
            f"tf_sparsify: compiled ops unavailable ({lib.reason}); using the pure-TF reference",
            RuntimeWarning,
            stacklevel=3,
        )
    return None


def is_compiled() -> bool:
    """Whether the compiled kernels are loaded."""
    return _library().module is not None


@dataclass(frozen=True)
class OpsInfo:
    """What :func:`info` reports; ``str()`` gives a readable summary."""

    compiled: bool
    library: str
    reason: str | None
    kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gpus: tuple[str, ...] = ()
    tensorflow: str = tf.__version__

    def __str__(self) -> str:
        if not self.compiled:
            return (
                f"tf_sparsify ops: compiled kernels NOT loaded ({self.reason});\n"
                "  every op runs the pure-TF reference (tf_sparsify.ops.reference)"
            )
        lines = [f"tf_sparsify ops: compiled kernels loaded from {self.library}"]
        lines += [f"  {op}: {', '.join(devs) or 'no kernels'}" for op, devs in self.kernels.items()]
        lines.append(
            f"  GPUs visible to TensorFlow {self.tensorflow}: {', '.join(self.gpus) or 'none'}"
        )
        return "\n".join(lines)


def _registered_devices(op: str) -> tuple[str, ...]:
    from tensorflow.python.framework import kernels

    found = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
    return tuple(sorted(found))


def info() -> OpsInfo:
    """Which compiled kernels are loaded and for which devices."""
    lib = _library()
    gpus = tuple(d.name for d in tf.config.list_physical_devices("GPU"))
    if lib.module is None:
        return OpsInfo(False, str(LIBRARY_PATH), lib.reason, gpus=gpus)
    kernels = {op: _registered_devices(op) for op in OP_NAMES}
    return OpsInfo(True, str(LIBRARY_PATH), None, kernels, gpus)


def _invalid(message: str) -> tf.errors.InvalidArgumentError:
    return tf.errors.InvalidArgumentError(None, None, message)


def _check_float(name: str, dtype: tf.DType) -> None:
    if dtype not in FLOAT_DTYPES:
        raise _invalid(f"{name} must be float16, bfloat16, float32 or float64, got {dtype.name}")


def _static_int(value: Any) -> int | None:
    """``value`` as a Python int when it is one (or a NumPy integer), else None."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    return None


def topk_error_feedback(
    grad: tf.Tensor, residual: tf.Tensor, k: int | tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Fused top-k with error feedback: ``(values, indices, new_residual)``.

    ``acc = grad + residual`` in the input dtype; the k entries of largest magnitude, ranked by
    the IEEE bit pattern with the sign cleared, are selected: NaN ranks above +Inf (so NaNs are
    always sent and never kept in the residual), +0.0 equals -0.0, ties go to the lowest flat
    index. ``indices`` are ascending flat indices (int32 below 2**31 elements, else int64),
    ``values = acc[indices]``, ``new_residual`` is ``acc`` with those entries zeroed.
    """
    grad = tf.convert_to_tensor(grad)
    residual = tf.convert_to_tensor(residual)
    _check_float("grad", grad.dtype)
    if residual.dtype != grad.dtype:
        raise _invalid(
            f"residual must have grad's dtype {grad.dtype.name}, got {residual.dtype.name}"
        )
    if not grad.shape.is_compatible_with(residual.shape):
        raise _invalid(f"residual must have grad's shape {grad.shape}, got {residual.shape}")
    n = grad.shape.num_elements()
    k_int = _static_int(k)
    if k_int is not None and (k_int < 0 or (n is not None and k_int > n)):
        bound = f"[0, {n}] (the number of elements of grad)" if n is not None else ">= 0"
        raise _invalid(f"k must be in {bound}, got k = {k_int}")
    ops = _compiled()
    if ops is None:
        return reference.topk_error_feedback(grad, residual, k)
    index_type = reference.index_dtype(n) if n is not None else tf.int64
    return tuple(ops.top_k_error_feedback(grad, residual, k, index_type=index_type))


def _check_qsgd_attrs(levels: Any, bucket_size: Any) -> tuple[int, int]:
    lv, bs = _static_int(levels), _static_int(bucket_size)
    if lv is None or not 1 <= lv <= MAX_LEVELS:
        raise _invalid(f"levels must be an int in [1, {MAX_LEVELS}], got levels = {levels!r}")
    if bs is None or bs < 0:
        raise _invalid(f"bucket_size must be an int >= 0 (0 = one bucket), got {bucket_size!r}")
    return lv, bs


def qsgd_quantize(
    tensor: tf.Tensor, levels: int, bucket_size: int, seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """QSGD: flat ``(signed_levels, norms)``, int8 levels for ``levels <= 127`` else int16.

    Buckets of ``bucket_size`` flat entries (0: the whole tensor) are scaled by their float32
    L2 norm and rounded stochastically with ``hash_uniform(seed, i)``, so the same seed gives
    the same payload on every path. NaN entries (and Inf entries, as Inf/Inf) get level 0.
    """
    tensor = tf.convert_to_tensor(tensor)
    _check_float("tensor", tensor.dtype)
    levels, bucket_size = _check_qsgd_attrs(levels, bucket_size)
    seed = tf.cast(seed, tf.int64)
    if seed.shape.rank not in (None, 0):
        raise _invalid(f"seed must be a scalar, got shape {seed.shape}")
    ops = _compiled()
    if ops is None:
        return reference.qsgd_quantize(tensor, levels, bucket_size, seed)
    out_type = reference.level_dtype(levels)
    result = ops.qsgd_quantize(
        tensor, seed, levels=levels, bucket_size=bucket_size, out_type=out_type
    )
    return tuple(result)


def qsgd_dequantize(
    signed_levels: tf.Tensor,
    norms: tf.Tensor,
    levels: int,
    bucket_size: int,
    shape: tf.TensorShape | list[int] | tf.Tensor,
    dtype: tf.DType,
) -> tf.Tensor:
    """QSGD decoder: ``norm_of_bucket * signed_level / levels`` as ``dtype`` in ``shape``."""
    signed_levels = tf.convert_to_tensor(signed_levels)
    norms = tf.convert_to_tensor(norms)
    levels, bucket_size = _check_qsgd_attrs(levels, bucket_size)
    dtype = tf.as_dtype(dtype)
    _check_float("dtype", dtype)
    want = reference.level_dtype(levels)
    if signed_levels.dtype != want:
        raise _invalid(
            f"signed_levels must be {want.name} for levels = {levels}, "
            f"got {signed_levels.dtype.name}"
        )
    if norms.dtype != tf.float32:
        raise _invalid(f"norms must be float32, got {norms.dtype.name}")
    n = signed_levels.shape.num_elements()
    if not isinstance(shape, tf.Tensor):
        dims = tf.TensorShape(shape)
        if not dims.is_fully_defined():
            raise _invalid(f"shape must be fully defined, got {dims}")
        if n is not None and dims.num_elements() != n:
            raise _invalid(
                f"shape {dims.as_list()} has {dims.num_elements()} elements but signed_levels "
                f"has {n}"
            )
        shape = tf.constant(dims.as_list(), tf.int64)
    buckets = None if n is None else num_buckets(n, bucket_size)
    if norms.shape.rank is not None and (
        norms.shape.rank != 1 or norms.shape[0] not in (None, buckets)
    ):
        raise _invalid(
            f"norms must be a vector of {buckets} bucket norms ({n} elements, "
            f"bucket_size = {bucket_size}), got shape {norms.shape.as_list()}"
        )
    ops = _compiled()
    if ops is None:
        return reference.qsgd_dequantize(signed_levels, norms, levels, bucket_size, shape, dtype)
    return ops.qsgd_dequantize(
        signed_levels, norms, shape, levels=levels, bucket_size=bucket_size, dtype=dtype
    )
