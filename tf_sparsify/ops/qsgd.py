"""QSGD: stochastic quantization of buckets by their norm (:func:`qsgd_quantize`) and its
decoder (:func:`qsgd_dequantize`); the buckets are :mod:`tf_sparsify.ops.qsgd_buckets`'."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import invalid_argument
from tf_sparsify.ops import dispatch, pure_tf
from tf_sparsify.ops.arguments import MAX_INT64, check_float, int_in_range
from tf_sparsify.ops.qsgd_buckets import num_buckets

#: the most levels (int16 payloads)
MAX_LEVELS = 32767


def _check_qsgd_attrs(levels: Any, bucket_size: Any) -> tuple[int, int]:
    levels = int_in_range(
        levels,
        1,
        MAX_LEVELS,
        f"levels must be an int in [1, {MAX_LEVELS}], got levels = {levels!r}",
    )
    bucket_size = int_in_range(
        bucket_size,
        0,
        MAX_INT64,
        f"bucket_size must be an int in [0, 2**63) (0 = one bucket), got {bucket_size!r}",
    )
    return levels, bucket_size


def _seed_tensor(seed: Any) -> tf.Tensor:
    """``seed``, an integer scalar (a Python int or an integer tensor), as int64; a float
    (which a cast would truncate) or a bool is refused."""
    tensor = tf.convert_to_tensor(seed)
    if not tensor.dtype.is_integer:
        raise invalid_argument(
            f"seed must be an integer scalar, got seed = {seed!r} (dtype {tensor.dtype.name})"
        )
    if tensor.shape.rank not in (None, 0):
        raise invalid_argument(f"seed must be a scalar, got shape {tensor.shape}")
    return tf.cast(tensor, tf.int64)


def qsgd_quantize(
    tensor: tf.Tensor, levels: int, bucket_size: int, seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """QSGD: flat ``(signed_levels, norms)``, int8 levels for ``levels <= 127`` else int16.

    Buckets of ``bucket_size`` flat entries (0, or any size >= n: the whole tensor) are scaled
    by their float32 L2 norm and rounded stochastically with ``hash_uniform(seed, i)``, so the
    same seed gives the same payload on every path. NaN entries (and Inf entries, as Inf/Inf)
    get level 0. Denormals and values near float32's maximum: see
    :mod:`tf_sparsify.ops.pure_tf`.
    """
    tensor = tf.convert_to_tensor(tensor)
    check_float("tensor", tensor.dtype)
    levels, bucket_size = _check_qsgd_attrs(levels, bucket_size)
    seed = _seed_tensor(seed)
    out_type = pure_tf.level_dtype(levels)
    return dispatch.run(
        lambda ops: tuple(
            ops.qsgd_quantize(
                tensor, seed, levels=levels, bucket_size=bucket_size, out_type=out_type
            )
        ),
        lambda: pure_tf.qsgd_quantize(tensor, levels, bucket_size, seed),
    )


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
    check_float("dtype", dtype)
    want = pure_tf.level_dtype(levels)
    if signed_levels.dtype != want:
        raise invalid_argument(
            f"signed_levels must be {want.name} for levels = {levels}, "
            f"got {signed_levels.dtype.name}"
        )
    if norms.dtype != tf.float32:
        raise invalid_argument(f"norms must be float32, got {norms.dtype.name}")
    n = signed_levels.shape.num_elements()
    if not isinstance(shape, tf.Tensor):
        dims = tf.TensorShape(shape)
        if not dims.is_fully_defined():
            raise invalid_argument(f"shape must be fully defined, got {dims}")
        if n is not None and dims.num_elements() != n:
            raise invalid_argument(
                f"shape {dims.as_list()} has {dims.num_elements()} elements but signed_levels "
                f"has {n}"
            )
        shape = tf.constant(dims.as_list(), tf.int64)
    buckets = None if n is None else num_buckets(n, bucket_size)
    if norms.shape.rank is not None and (
        norms.shape.rank != 1 or norms.shape[0] not in (None, buckets)
    ):
        raise invalid_argument(
            f"norms must be a vector of {buckets} bucket norms ({n} elements, "
            f"bucket_size = {bucket_size}), got shape {norms.shape.as_list()}"
        )
    return dispatch.run(
        lambda ops: ops.qsgd_dequantize(
            signed_levels, norms, shape, levels=levels, bucket_size=bucket_size, dtype=dtype
        ),
        lambda: pure_tf.qsgd_dequantize(signed_levels, norms, levels, bucket_size, shape, dtype),
    )
