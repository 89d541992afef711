"""Custom ops: fused TopK with error feedback, QSGD quantization, a dense scatter-sum, the
Elias-Fano code of TopK's indices, a plain SGD step from sparse updates, a 16-bit cast with
error feedback and the sum of gathered 16-bit payloads.

Each function runs the compiled kernels (built by ``python -m tf_sparsify.ops.build``, loaded by
:mod:`tf_sparsify.ops.library`) when they load, and otherwise the pure-TF reference in
:mod:`tf_sparsify.ops.pure_tf`, which gives identical results, with a one-time warning. With
``TF_SPARSIFY_REQUIRE_OPS=1`` a missing library raises RuntimeError instead. Traced for XLA
(``jit_compile=True``, see :mod:`tf_sparsify.ops.xla`), where no custom kernel can run, the
reference runs silently (also under ``TF_SPARSIFY_REQUIRE_OPS=1``), without the run-time check
of ``scatter_sum``'s indices (XLA raises no errors at run time). Arguments are checked here for
both paths; invalid ones raise InvalidArgumentError naming the argument.

Numerics shared by every path (CPU kernel, CUDA core, pure-TF reference on CPU, NumPy model):

* Denormals: float32 and float64 arithmetic (and bfloat16's, done in float32) reads denormal
  inputs as zero and flushes denormal results to zero, keeping the sign, as TensorFlow's CPU
  kernels do (x86 DAZ/FTZ; a result is flushed when, rounded to the type's precision with an
  unbounded exponent, it is below the smallest normal). float16 is computed in float32, where
  its denormals are normal numbers, so they are kept, as in TensorFlow.
* QSGD saturates instead of overflowing: finite inputs beyond float32's range count as
  +-float32 max, bucket norms above float32 max are sent as float32 max (levels are capped at
  ``levels``), and decoded values are clamped to the output dtype's largest finite magnitude.
  Finite inputs thus never give Inf or NaN; Inf and NaN inputs keep their documented effect.
* bfloat16 results computed in float32 (TopK's ``grad + residual``, QSGD's decoded values) are
  rounded to nearest even, and a NaN becomes the quiet NaN with its sign: 0x7FC0 or 0xFFC0
  (x86 makes Inf + -Inf and 0 * Inf negative NaNs), where ``tf.cast`` gives 0x7FC0 or 0xFFC0
  depending on the tensor's length. On a GPU, QSGD's NaNs carry the GPU's own bits.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from tf_sparsify.ops import index_code, library, pure_tf
from tf_sparsify.ops.gpu import format_cuda
from tf_sparsify.ops.xla import in_xla_context
from tf_sparsify.testing.numpy_reference import num_buckets

__all__ = [
    "OpsInfo",
    "decode_indices",
    "encode_indices",
    "in_xla_context",
    "info",
    "is_compiled",
    "qsgd_dequantize",
    "qsgd_quantize",
    "saturating_cast_feedback",
    "scatter_sum",
    "sparse_sgd_apply",
    "topk_error_feedback",
    "topk_error_feedback_packed",
    "encode_indices_packed",
    "decode_indices_packed",
    "packed_decompress_sum",
    "wire_to_float",
    "wire_sum",
    "sparse_sgd_apply_packed",
]

REQUIRE_ENV = "TF_SPARSIFY_REQUIRE_OPS"
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
INDEX_DTYPES = (tf.int32, tf.int64)
WIRE_DTYPES = (tf.float16, tf.bfloat16)
MAX_LEVELS = 32767
GPU_MAX_ELEMENTS = 2**31 - 1

_warned = False


@functools.cache
def _library() -> library.Library:
    return library.load()


# Load at import so that graphs and SavedModels using the ops can be imported right away.
_library()


def _compiled() -> Any:
    """The loaded op module; None under XLA (silently: the reference compiles there) or, after
    warning once, when it did not load (error under TF_SPARSIFY_REQUIRE_OPS)."""
    global _warned
    if in_xla_context():
        return None
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
    cuda_built: str | None = None
    cuda_archs: tuple[str, ...] = ()
    cuda_driver: str | None = None
    gpu_kernels: bool = False
    gpu_reason: str | None = None
    origin: str | None = None

    def __str__(self) -> str:
        if not self.compiled:
            return (
                f"tf_sparsify ops: compiled kernels NOT loaded ({self.reason});\n"
                "  every op runs the pure-TF reference (tf_sparsify.ops.pure_tf)"
            )
        lines = [
            f"tf_sparsify ops: compiled kernels loaded from {self.library}",
            f"  origin: {self.origin}",
        ]
        lines += [f"  {op}: {', '.join(devs) or 'no kernels'}" for op, devs in self.kernels.items()]
        driver = f"CUDA {self.cuda_driver}" if self.cuda_driver else "none found"
        if self.cuda_built:
            archs = ", ".join(f"sm_{a}" for a in self.cuda_archs)
            lines.append(f"  CUDA: built with CUDA {self.cuda_built} ({archs}); driver: {driver}")
            state = "loaded" if self.gpu_kernels else f"NOT loaded ({self.gpu_reason})"
            lines.append(f"  GPU kernels: {state}")
        else:
            lines.append(f"  CUDA: GPU kernels {self.gpu_reason}; driver: {driver}")
        lines.append(
            f"  GPUs visible to TensorFlow {self.tensorflow}: {', '.join(self.gpus) or 'none'}"
        )
        return "\n".join(lines)


def _registered_devices(op: str) -> tuple[str, ...]:
    from tensorflow.python.framework import kernels

    found = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
    return tuple(sorted(found))


def info() -> OpsInfo:
    """Which compiled kernels are loaded, for which devices, and the CUDA versions involved."""
    lib = _library()
    gpus = tuple(d.name for d in tf.config.list_physical_devices("GPU"))
    path = str(lib.directory) if lib.directory else "(none)"
    if lib.module is None:
        return OpsInfo(False, path, lib.reason, gpus=gpus)
    kernels = {op: _registered_devices(op) for op in library.OP_NAMES}
    build = lib.build or {}
    return OpsInfo(
        True,
        path,
        None,
        kernels,
        gpus,
        cuda_built=build.get("cuda"),
        cuda_archs=tuple(build.get("cuda_archs", ())),
        cuda_driver=format_cuda(lib.driver) if lib.driver else None,
        gpu_kernels=lib.gpu_loaded,
        gpu_reason=lib.gpu_reason,
        origin=f"{library.origin(build)} for TensorFlow {build.get('tensorflow')}",
    )


def _invalid(message: str) -> tf.errors.InvalidArgumentError:
    return tf.errors.InvalidArgumentError(None, None, message)


def _check_float(name: str, dtype: tf.DType) -> None:
    if dtype not in FLOAT_DTYPES:
        raise _invalid(f"{name} must be float16, bfloat16, float32 or float64, got {dtype.name}")


def _static_int(value: Any) -> int | None:
    """``value`` as a Python int when it is one (or a NumPy integer), else None."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return int(value)
    return None


def _check_k(k: Any, n: int | None) -> int | tf.Tensor:
    """``k`` as a checked Python int, or an int32/int64 scalar tensor (checked by the kernel)."""
    k_int = _static_int(k)
    if k_int is None:
        if isinstance(k, (bool, np.bool_, float, np.floating, str)):
            raise _invalid(f"k must be an integer, got k = {k!r} ({type(k).__name__})")
        k = tf.convert_to_tensor(k)
        if k.dtype not in INDEX_DTYPES:
            raise _invalid(f"k must be an int32 or int64 scalar, got dtype {k.dtype.name}")
        if k.shape.rank not in (None, 0):
            raise _invalid(f"k must be a scalar, got shape {k.shape}")
        return k
    if k_int < 0 or (n is not None and k_int > n):
        bound = f"[0, {n}] (the number of elements of grad)" if n is not None else ">= 0"
        raise _invalid(f"k must be in {bound}, got k = {k_int}")
    return k_int


def _check_index_dtype(index_dtype: Any, n: int | None) -> tf.DType:
    if index_dtype is None:
        return pure_tf.index_dtype(n)
    dtype = tf.as_dtype(index_dtype)
    if dtype not in INDEX_DTYPES:
        raise _invalid(f"index_dtype must be int32 or int64, got {dtype.name}")
    if dtype == tf.int32 and n is not None and n > pure_tf.MAX_INT32_ELEMENTS:
        raise _invalid(f"index_dtype int32 cannot index {n} elements; use tf.int64")
    return dtype


def topk_error_feedback(
    grad: tf.Tensor,
    residual: tf.Tensor,
    k: int | tf.Tensor,
    index_dtype: tf.DType | None = None,
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Fused top-k with error feedback: ``(values, indices, new_residual)``.

    ``acc = grad + residual`` in the input dtype (denormals flushed, see the module docstring);
    the k entries of largest magnitude, ranked by the IEEE bit pattern with the sign cleared, are
    selected: NaN ranks above +Inf (so NaNs are always sent and never kept in the residual),
    +0.0 equals -0.0, ties go to the lowest flat index. ``indices`` are ascending flat indices,
    ``values = acc[indices]``, ``new_residual`` is ``acc`` with those entries zeroed.

    ``k`` is an int (or an int32/int64 scalar tensor) in ``[0, n]``. ``index_dtype`` defaults to
    int32, or int64 when the static size is ``2**31`` elements or more; with an unknown static
    size and int32 indices, a tensor that turns out that large fails with InvalidArgumentError
    (pass ``index_dtype=tf.int64``). The GPU kernel takes fewer than ``2**31`` elements: larger
    tensors of known size run on the CPU kernel, unknown-size ones fail on GPU saying so.
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
    k = _check_k(k, n)
    index_type = _check_index_dtype(index_dtype, n)
    ops = _compiled()
    if ops is None:
        return pure_tf.topk_error_feedback(grad, residual, k, index_type)
    if n is not None and n > GPU_MAX_ELEMENTS:
        with tf.device("/device:CPU:0"):
            return tuple(ops.top_k_error_feedback(grad, residual, k, index_type=index_type))
    return tuple(ops.top_k_error_feedback(grad, residual, k, index_type=index_type))


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
        raise _invalid(
            f"need as many residuals and ks as grads (at least one); got {len(grads)} grads, "
            f"{len(residuals)} residuals, {len(ks)} ks"
        )
    sizes = []
    for i, (g, r) in enumerate(zip(grads, residuals, strict=True)):
        _check_float(f"grads[{i}]", g.dtype)
        if g.dtype != grads[0].dtype or r.dtype != g.dtype:
            raise _invalid(
                f"grads and residuals must share one dtype ({grads[0].dtype.name}); "
                f"grads[{i}] is {g.dtype.name}, residuals[{i}] is {r.dtype.name}"
            )
        if not g.shape.is_fully_defined() or g.shape != r.shape:
            raise _invalid(
                f"residuals[{i}] must have grads[{i}]'s static shape {g.shape}, got {r.shape}"
            )
        sizes.append(g.shape.num_elements())
    ks = [_check_k(k, n) for k, n in zip(ks, sizes, strict=True)]
    index_type = pure_tf.index_dtype(max(sizes))
    compiled = _compiled()
    if compiled is None:
        parts = [
            pure_tf.topk_error_feedback(g, r, k, index_type)
            for g, r, k in zip(grads, residuals, ks, strict=True)
        ]
        return (
            tf.concat([p[0] for p in parts], 0),
            tf.concat([p[1] for p in parts], 0),
            [p[2] for p in parts],
        )
    values, indices, new_residuals = compiled.top_k_error_feedback_packed(
        grads, residuals, ks=ks, index_type=index_type
    )
    return values, indices, list(new_residuals)


def encode_indices_packed(indices: tf.Tensor, sizes: list[tuple[int, int]]) -> tf.Tensor:
    """:func:`encode_indices` of consecutive segments of ``indices``, segment ``i`` holding
    ``k`` ascending indices below ``n`` for ``(n, k) = sizes[i]``; the codes concatenated."""
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in INDEX_DTYPES or indices.shape.rank != 1:
        raise _invalid(
            f"indices must be an int32/int64 vector, got {indices.dtype.name} "
            f"of shape {indices.shape}"
        )
    compiled = _compiled()
    if compiled is None:
        parts = tf.split(indices, [k for _, k in sizes]) if sizes else []
        return tf.concat(
            [index_code.reference_encode(p, n) for p, (n, _) in zip(parts, sizes, strict=True)],
            0,
        )
    return compiled.index_code_encode_packed(
        indices,
        num_elements=[n for n, _ in sizes],
        ks=[k for _, k in sizes],
        low_bits=[index_code.low_bits_for(n, k) for n, k in sizes],
    )


def decode_indices_packed(code: tf.Tensor, sizes: list[tuple[int, int]]) -> tf.Tensor:
    """Inverse of :func:`encode_indices_packed`, row by row: ``code [replicas, bytes]`` gives
    the ``[replicas, sum(k)]`` indices, each segment's flat within its own tensor (int32, int64
    when a segment has ``2**31`` elements or more)."""
    code = tf.convert_to_tensor(code)
    index_type = pure_tf.index_dtype(max((n for n, _ in sizes), default=0))
    compiled = _compiled()
    if compiled is None:
        code_bytes = [index_code.index_code_bytes(n, k) for n, k in sizes]
        parts = tf.split(code, code_bytes, axis=1)
        return tf.concat(
            [decode_indices(c, n, k, index_type) for c, (n, k) in zip(parts, sizes, strict=True)],
            1,
        )
    return compiled.index_code_decode_packed(
        code,
        num_elements=[n for n, _ in sizes],
        ks=[k for _, k in sizes],
        low_bits=[index_code.low_bits_for(n, k) for n, k in sizes],
        index_type=index_type,
    )


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
    _check_float("values", values.dtype)
    shapes, ks = _check_shapes_and_ks(shapes, ks)
    if values.shape.rank is not None and (
        values.shape.rank != 2 or values.shape[1] not in (None, sum(ks))
    ):
        raise _invalid(f"values must be [replicas, sum(ks) = {sum(ks)}], got {values.shape}")
    ns = [s.num_elements() for s in shapes]
    scale_t = tf.constant(scale, values.dtype)
    compiled = _compiled()
    if compiled is None:
        code_bytes = [index_code.index_code_bytes(n, k) for n, k in zip(ns, ks, strict=True)]
        value_parts = tf.split(values, ks, axis=1)
        code_parts = tf.split(code, code_bytes, axis=1)
        out = []
        for v, c, n, k, shape in zip(value_parts, code_parts, ns, ks, shapes, strict=True):
            idx = decode_indices(c, n, k)
            dense = pure_tf.scatter_sum(tf.reshape(v, [-1]), tf.reshape(idx, [-1]), n)
            out.append(tf.reshape(dense * scale_t if scale != 1 else dense, shape))
        return out
    return list(
        compiled.packed_decompress_sum(
            values,
            code,
            scale_t,
            N=len(shapes),
            shapes=shapes,
            ks=ks,
            low_bits=[index_code.low_bits_for(n, k) for n, k in zip(ns, ks, strict=True)],
        )
    )


def _check_shapes_and_ks(
    shapes: Sequence[Any], ks: Sequence[Any]
) -> tuple[list[tf.TensorShape], list[int]]:
    """``shapes`` as fully defined TensorShapes and ``ks`` as ints, one per shape, each in
    ``[0, elements of its shape]``."""
    if len(ks) != len(shapes):
        raise _invalid(
            f"ks must have one k per shape (len(shapes) = {len(shapes)}), got len(ks) = "
            f"{len(ks)}: ks = {ks}"
        )
    shapes = [tf.TensorShape(s) for s in shapes]
    checked = []
    for i, (shape, k) in enumerate(zip(shapes, ks, strict=True)):
        if not shape.is_fully_defined():
            raise _invalid(f"shapes[{i}] must be fully defined, got {shape}")
        n, k_int = shape.num_elements(), _static_int(k)
        if k_int is None or not 0 <= k_int <= n:
            raise _invalid(f"ks[{i}] must be an int in [0, {n}] (shapes[{i}] = {shape}), got {k!r}")
        checked.append(k_int)
    return shapes, checked


def _check_qsgd_attrs(levels: Any, bucket_size: Any) -> tuple[int, int]:
    lv, bs = _static_int(levels), _static_int(bucket_size)
    if lv is None or not 1 <= lv <= MAX_LEVELS:
        raise _invalid(f"levels must be an int in [1, {MAX_LEVELS}], got levels = {levels!r}")
    if bs is None or not 0 <= bs < 2**63:
        raise _invalid(
            f"bucket_size must be an int in [0, 2**63) (0 = one bucket), got {bucket_size!r}"
        )
    return lv, bs


def _check_seed(seed: Any) -> tf.Tensor:
    """``seed``, an integer scalar (a Python int or an integer tensor), as int64; a float
    (which a cast would truncate) or a bool is refused."""
    tensor = tf.convert_to_tensor(seed)
    if not tensor.dtype.is_integer:
        raise _invalid(
            f"seed must be an integer scalar, got seed = {seed!r} (dtype {tensor.dtype.name})"
        )
    if tensor.shape.rank not in (None, 0):
        raise _invalid(f"seed must be a scalar, got shape {tensor.shape}")
    return tf.cast(tensor, tf.int64)


def qsgd_quantize(
    tensor: tf.Tensor, levels: int, bucket_size: int, seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """QSGD: flat ``(signed_levels, norms)``, int8 levels for ``levels <= 127`` else int16.

    Buckets of ``bucket_size`` flat entries (0, or any size >= n: the whole tensor) are scaled
    by their float32 L2 norm and rounded stochastically with ``hash_uniform(seed, i)``, so the
    same seed gives the same payload on every path. NaN entries (and Inf entries, as Inf/Inf)
    get level 0. Denormals and values near float32's maximum: see the module docstring.
    """
    tensor = tf.convert_to_tensor(tensor)
    _check_float("tensor", tensor.dtype)
    levels, bucket_size = _check_qsgd_attrs(levels, bucket_size)
    seed = _check_seed(seed)
    ops = _compiled()
    if ops is None:
        return pure_tf.qsgd_quantize(tensor, levels, bucket_size, seed)
    out_type = pure_tf.level_dtype(levels)
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
    """QSGD decoder: ``signed_level * (norm_of_bucket / levels)`` as ``dtype`` in ``shape``,
    clamped to ``dtype``'s largest finite magnitude."""
    signed_levels = tf.convert_to_tensor(signed_levels)
    norms = tf.convert_to_tensor(norms)
    levels, bucket_size = _check_qsgd_attrs(levels, bucket_size)
    dtype = tf.as_dtype(dtype)
    _check_float("dtype", dtype)
    want = pure_tf.level_dtype(levels)
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
        return pure_tf.qsgd_dequantize(signed_levels, norms, levels, bucket_size, shape, dtype)
    return ops.qsgd_dequantize(
        signed_levels, norms, shape, levels=levels, bucket_size=bucket_size, dtype=dtype
    )


def _check_vector(name: str, t: tf.Tensor) -> None:
    if t.shape.rank not in (None, 1):
        raise _invalid(f"{name} must be a vector, got shape {t.shape}")


def _check_n(n: Any) -> int | tf.Tensor:
    """``n`` as a checked Python int, or an int64 scalar tensor (checked by the kernel)."""
    n_int = _static_int(n)
    if n_int is not None:
        if not 0 <= n_int < 2**63:
            raise _invalid(f"n must be an int in [0, 2**63), got n = {n_int}")
        return n_int
    if isinstance(n, (bool, np.bool_, float, np.floating, str)):
        raise _invalid(f"n must be an integer, got n = {n!r} ({type(n).__name__})")
    n = tf.convert_to_tensor(n)
    if n.dtype not in INDEX_DTYPES:
        raise _invalid(f"n must be an int32 or int64 scalar, got dtype {n.dtype.name}")
    if n.shape.rank not in (None, 0):
        raise _invalid(f"n must be a scalar, got shape {n.shape}")
    return tf.cast(n, tf.int64)


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
    _check_float("values", values.dtype)
    if indices.dtype not in INDEX_DTYPES:
        raise _invalid(f"indices must be int32 or int64, got {indices.dtype.name}")
    _check_vector("values", values)
    _check_vector("indices", indices)
    if not values.shape.is_compatible_with(indices.shape):
        raise _invalid(
            f"indices must have the length of values ({values.shape[0]}), got {indices.shape[0]}"
        )
    n = _check_n(n)
    ops = _compiled()
    if ops is None:
        return pure_tf.scatter_sum(values, indices, n)
    return ops.scatter_sum(values, indices, n)


def _check_num_elements(num_elements: Any) -> int:
    """``num_elements`` as a Python int in ``[0, 2**63)`` (an int64 attribute)."""
    n = _static_int(num_elements)
    if n is None or not 0 <= n < 2**63:
        raise _invalid(f"num_elements must be an int in [0, 2**63), got {num_elements!r}")
    return n


def encode_indices(indices: tf.Tensor, num_elements: int) -> tf.Tensor:
    """The Elias-Fano code of strictly ascending flat ``indices`` (int32/int64, static length
    k) in ``[0, num_elements)``: uint8 of :func:`~tf_sparsify.ops.index_code.index_code_bytes`
    bytes, about ``2 + log2(num_elements / k)`` bits per index (layout:
    :mod:`tf_sparsify.ops.index_code`). The kernel fails on unsorted, repeated or out-of-range
    indices; the pure-TF reference does not check them. CPU kernel only (a few bytes per index
    move to and from a GPU)."""
    indices = tf.convert_to_tensor(indices)
    if indices.dtype not in INDEX_DTYPES:
        raise _invalid(f"indices must be int32 or int64, got {indices.dtype.name}")
    if indices.shape.rank != 1 or indices.shape[0] is None:
        raise _invalid(f"indices must be a vector of static length, got shape {indices.shape}")
    n = _check_num_elements(num_elements)
    ops = _compiled()
    if ops is None:
        return index_code.reference_encode(indices, n)
    low = index_code.low_bits_for(n, indices.shape[0])
    return ops.index_code_encode(indices, num_elements=n, low_bits=low)


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
    n, k_int = _check_num_elements(num_elements), _static_int(k)
    if k_int is None or not 0 <= k_int <= n:
        raise _invalid(f"need ints 0 <= k <= num_elements, got k={k!r}, {num_elements=!r}")
    size = index_code.index_code_bytes(n, k_int)
    if code.dtype != tf.uint8 or code.shape.rank in (None, 0) or code.shape[-1] != size:
        raise _invalid(
            f"code must be uint8 with {size} bytes on its last axis (k={k_int} of {n} "
            f"indices); got dtype={code.dtype.name}, shape={code.shape}"
        )
    index_dtype = _check_index_dtype(index_dtype, n)
    ops = _compiled()
    if ops is None:
        return index_code.reference_decode(code, n, k_int, index_dtype)
    low = index_code.low_bits_for(n, k_int)
    return ops.index_code_decode(
        code, num_elements=n, k=k_int, low_bits=low, index_type=index_dtype
    )


def _scalar(value: float | tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``value`` in ``dtype``; a Python number is rounded once, to ``dtype`` (``tf.cast`` would
    round it to float32 first)."""
    if isinstance(value, (int, float, np.number)):
        return tf.constant(value, dtype)
    return tf.cast(value, dtype)


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
    ops = _compiled()
    if ops is None:
        pure_tf.sparse_sgd_apply(variable, values, indices, scale, learning_rate)
        return
    ops.sparse_sgd_apply(handle, values, indices, scale, learning_rate)


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
        raise _invalid(f"ks must be {len(handles)} counts >= 0 (one per variable), got {ks}")
    values, indices, scale, learning_rate = _sgd_entries(
        values, indices, scale, learning_rate, dtype
    )
    if values.shape[1] is not None and values.shape[1] != sum(ks):
        raise _invalid(f"values must have sum(ks) = {sum(ks)} columns, got {values.shape}")
    ops = _compiled()
    if ops is None:
        columns = zip(tf.split(values, ks, axis=1), tf.split(indices, ks, axis=1), strict=True)
        for variable, (part_values, part_indices) in zip(variables, columns, strict=True):
            pure_tf.sparse_sgd_apply(variable, part_values, part_indices, scale, learning_rate)
        return
    ops.sparse_sgd_apply_packed(handles, values, indices, scale, learning_rate, ks=ks)


def _sgd_variables(variables: Sequence[Any], what: str) -> tuple[list[tf.Tensor], tf.DType]:
    """The resource handles of ``variables`` (at least one, one float dtype) and that dtype."""
    handles = [getattr(v, "handle", None) for v in variables]
    for i, (variable, handle) in enumerate(zip(variables, handles, strict=True)):
        if handle is None or handle.dtype != tf.resource:
            name = what if what == "variable" else f"{what}[{i}]"
            raise _invalid(f"{name} must be a resource variable, got {variable!r}")
    if not handles:
        raise _invalid(f"{what} must hold at least one variable")
    dtypes = {tf.as_dtype(v.dtype) for v in variables}
    if len(dtypes) != 1:
        raise _invalid(f"{what} must share one dtype, got {sorted(d.name for d in dtypes)}")
    dtype = dtypes.pop()
    _check_float(what, dtype)
    return handles, dtype


def _sgd_entries(values, indices, scale, learning_rate, dtype: tf.DType) -> tuple:
    """``values`` and ``indices`` checked as ``[rows, k]`` entries for variables of
    ``dtype``, with ``scale`` and ``learning_rate`` as scalars of ``dtype``."""
    values = tf.convert_to_tensor(values)
    indices = tf.convert_to_tensor(indices)
    if values.dtype != dtype:
        raise _invalid(
            f"values must have the variable's dtype {dtype.name}, got {values.dtype.name}"
        )
    if indices.dtype not in INDEX_DTYPES:
        raise _invalid(f"indices must be int32 or int64, got {indices.dtype.name}")
    if values.shape.rank not in (None, 2) or not values.shape.is_compatible_with(indices.shape):
        raise _invalid(
            f"values and indices must be [rows, k] of one shape, got {values.shape} and "
            f"{indices.shape}"
        )
    return values, indices, _scalar(scale, dtype), _scalar(learning_rate, dtype)


def _runs_on_cpu(tensor: tf.Tensor) -> bool:
    """Whether ``tensor`` is (or, placed by TensorFlow, will be) on a CPU: its device when
    known, else whether TensorFlow sees no GPU."""
    device = getattr(tensor, "device", "") or ""
    if device:
        return "CPU" in device.upper()
    return not tf.config.list_logical_devices("GPU")


def saturating_cast_feedback(
    grad: tf.Tensor,
    residual: tf.Tensor | None,
    wire_dtype: tf.DType,
    portable: bool = False,
) -> tuple[tf.Tensor, tf.Tensor | None]:
    """``(wire, new_residual)`` in one pass: ``v = grad + residual`` (``grad`` alone when
    ``residual`` is None), ``wire`` = ``v`` in ``wire_dtype`` (float16 or bfloat16), rounded to
    nearest even, finite values beyond its range saturated to its largest finite value, Inf
    kept, NaN as ``tf.cast`` gives it; ``new_residual = v - float(wire)`` (None without a
    residual). Denormals: see the module docstring.

    ``grad`` and ``residual`` are float32 or float64 of one shape. The CPU kernel takes float32
    (F16C or AVX512-BF16 where the CPU has them; ``portable=True``, for tests, forces its
    portable path, which gives the same bits); float64, tensors on a GPU (or, when the device
    is not known yet, any tensor while TensorFlow sees a GPU) and XLA run the pure-TF
    reference.
    """
    grad = tf.convert_to_tensor(grad)
    if grad.dtype not in (tf.float32, tf.float64):
        raise _invalid(f"grad must be float32 or float64, got {grad.dtype.name}")
    wire_dtype = tf.as_dtype(wire_dtype)
    if wire_dtype not in WIRE_DTYPES:
        raise _invalid(f"wire_dtype must be float16 or bfloat16, got {wire_dtype.name}")
    if residual is not None:
        residual = tf.convert_to_tensor(residual)
        if residual.dtype != grad.dtype:
            raise _invalid(
                f"residual must have grad's dtype {grad.dtype.name}, got {residual.dtype.name}"
            )
        if not grad.shape.is_compatible_with(residual.shape):
            raise _invalid(f"residual must have grad's shape {grad.shape}, got {residual.shape}")
    ops = _compiled() if grad.dtype == tf.float32 and _runs_on_cpu(grad) else None
    if ops is None:
        return pure_tf.saturating_cast_feedback(grad, residual, wire_dtype)
    residuals = [] if residual is None else [residual]
    wire, new = ops.saturating_cast_feedback(
        grad, residuals, wire_type=wire_dtype, portable=portable
    )
    return wire, (new[0] if new else None)


def wire_to_float(
    wire: tf.Tensor, scale: float | tf.Tensor = 1.0, portable: bool = False
) -> tuple[tf.Tensor, tf.Tensor]:
    """``(float32(wire) * scale, whether every entry of wire is finite)`` in one pass: the
    decoder of :func:`saturating_cast_feedback`'s wire (float16 or bfloat16), with the check
    the pipeline runs on received payloads. Denormal inputs and products flush to zero (see the
    module docstring). CPU kernel (``portable`` as in :func:`saturating_cast_feedback`); on a
    GPU and under XLA the pure-TF reference."""
    wire = tf.convert_to_tensor(wire)
    if wire.dtype not in WIRE_DTYPES:
        raise _invalid(f"wire must be float16 or bfloat16, got {wire.dtype.name}")
    scale = _scalar(scale, tf.float32)
    if scale.shape.rank not in (None, 0):
        raise _invalid(f"scale must be a scalar, got shape {scale.shape}")
    ops = _compiled() if _runs_on_cpu(wire) else None
    if ops is None:
        return pure_tf.wire_to_float(wire, scale)
    return tuple(ops.wire_to_float(wire, scale, portable=portable))


def wire_sum(gathered: tf.Tensor, portable: bool = False) -> tf.Tensor:
    """The sum over the first axis (the ranks) of ``gathered`` ``[P, ...]`` (float16 or
    bfloat16), in its dtype: bit for bit what ``tf.cast(tf.reduce_sum(tf.cast(gathered,
    tf.float32), axis=0), dtype)`` gives on CPU, in one pass. Each entry is added in float32
    from +0.0 in rank order (denormals: see the module docstring), then rounded once to nearest
    even, to Inf beyond the dtype's range (no saturation); a NaN sum is 0x7E00 (float16) or
    0x7FC0 (bfloat16), where ``tf.cast`` gives 0x7FC0 or 0xFFC0. With ``P = 1`` the row itself
    (NaNs likewise), as ``reduce_sum`` returns it. CPU kernel (``portable`` as in
    :func:`saturating_cast_feedback`); on a GPU and under XLA the pure-TF reference."""
    gathered = tf.convert_to_tensor(gathered)
    if gathered.dtype not in WIRE_DTYPES:
        raise _invalid(f"gathered must be float16 or bfloat16, got {gathered.dtype.name}")
    if gathered.shape.rank == 0:
        raise _invalid(f"gathered must have rank >= 1 (ranks first), got shape {gathered.shape}")
    ops = _compiled() if _runs_on_cpu(gathered) else None
    if ops is None:
        return pure_tf.wire_sum(gathered)
    return ops.wire_sum(gathered, portable=portable)
