"""Pure-TensorFlow reference implementations of the custom ops.

These define the semantics the compiled kernels must reproduce bit for bit:

* ``topk_error_feedback``: ``acc = grad + residual`` (in the input dtype); the k entries of
  largest magnitude are selected by the sign-masked IEEE bit pattern of ``acc`` (monotone in
  ``|acc|``; NaN ranks above +Inf, +0.0 and -0.0 are equal), ties go to the lowest flat index;
  ``indices`` are returned in ascending order, ``values = acc[indices]``, ``new_residual`` is
  ``acc`` with the selected entries set to zero.
* ``qsgd_quantize``: per bucket of ``bucket_size`` consecutive flat entries (the whole tensor
  when ``bucket_size`` is 0), ``norm = ||x_bucket||_2`` rounded to float32, its sum of squares
  taken in float64 in a fixed order (the bucket zero-padded to a power of two, adjacent pairs
  added level by level) so that every implementation gets the same bits;
  ``r = |x| / norm * levels``, ``level = floor(r) + (u < r - floor(r))`` with
  ``u = hash_uniform(seed, flat_index)``, capped at ``levels``; the payload is
  ``sign(x) * level`` as int8 (levels <= 127) or int16 (0 where the level is NaN), plus the
  float32 norms.
* ``hash_uniform``: a counter-based uniform in [0, 1) shared with the kernels, so the compiled
  QSGD and this reference give identical payloads for the same seed.
"""

from __future__ import annotations

import tensorflow as tf

_MASKS = {
    tf.float16: (tf.int16, 0x7FFF),
    tf.bfloat16: (tf.int16, 0x7FFF),
    tf.float32: (tf.int32, 0x7FFFFFFF),
    tf.float64: (tf.int64, 0x7FFFFFFFFFFFFFFF),
}


def index_dtype(num_elements: int) -> tf.DType:
    """int32 indices while they fit, int64 beyond."""
    return tf.int32 if num_elements < 2**31 else tf.int64


def magnitude_key(x: tf.Tensor) -> tf.Tensor:
    """Sign-masked bit pattern of ``x`` as a signed integer, monotone in ``|x|``."""
    int_dtype, mask = _MASKS[x.dtype]
    key = tf.bitwise.bitwise_and(tf.bitcast(x, int_dtype), tf.constant(mask, int_dtype))
    # top_k has no int16 kernel; widening keeps the order.
    return tf.cast(key, tf.int32) if int_dtype == tf.int16 else key


def topk_error_feedback(
    grad: tf.Tensor, residual: tf.Tensor, k: int
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Reference for the fused op: ``(values, indices, new_residual)``."""
    acc = grad + residual
    flat = tf.reshape(acc, [-1])
    n = flat.shape[0] if flat.shape[0] is not None else tf.size(flat)
    idx_dtype = index_dtype(int(n)) if isinstance(n, int) else tf.int64
    _, picked = tf.math.top_k(magnitude_key(flat), k=k, sorted=True, index_type=idx_dtype)
    indices = tf.sort(picked)
    values = tf.gather(flat, indices)
    new_flat = tf.tensor_scatter_nd_update(flat, tf.expand_dims(indices, 1), tf.zeros_like(values))
    return values, indices, tf.reshape(new_flat, tf.shape(acc))


def _fmix32(x: tf.Tensor) -> tf.Tensor:
    """MurmurHash3's 32-bit finalizer (a bijection with good avalanche)."""
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))
    x = x * tf.constant(0x85EBCA6B, tf.uint32)
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(13, tf.uint32)))
    x = x * tf.constant(0xC2B2AE35, tf.uint32)
    return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def hash_uniform(seed: tf.Tensor, num_elements: int | tf.Tensor) -> tf.Tensor:
    """``u_i = (fmix32(fmix32(i ^ key0) ^ key1) >> 8) * 2**-24`` for i in [0, n).

    ``key0`` and ``key1`` are the low and high 32 bits of the int64 ``seed``.
    """
    seed = tf.cast(seed, tf.int64)
    key0 = tf.cast(tf.bitwise.bitwise_and(seed, 0xFFFFFFFF), tf.uint32)
    key1 = tf.cast(tf.bitwise.bitwise_and(tf.bitwise.right_shift(seed, 32), 0xFFFFFFFF), tf.uint32)
    i = tf.cast(tf.range(num_elements, dtype=tf.int64), tf.uint32)
    h = _fmix32(tf.bitwise.bitwise_xor(_fmix32(tf.bitwise.bitwise_xor(i, key0)), key1))
    mantissa = tf.bitwise.right_shift(h, tf.constant(8, tf.uint32))
    return tf.cast(mantissa, tf.float32) * (2.0**-24)


def level_dtype(levels: int) -> tf.DType:
    """Smallest signed integer type holding ``-levels .. levels``."""
    return tf.int8 if levels <= 127 else tf.int16


def _bucketed(flat: tf.Tensor, bucket_size: int) -> tf.Tensor:
    """``flat`` zero-padded to whole buckets, shape ``[num_buckets, bucket_size]``."""
    n = tf.size(flat)
    pad = (-n) % bucket_size
    return tf.reshape(tf.pad(flat, [[0, pad]]), [-1, bucket_size])


def _pow2_ceil(x: tf.Tensor) -> tf.Tensor:
    """Smallest power of two >= ``x`` (an int64 scalar >= 1)."""
    (p,) = tf.while_loop(lambda p: p < x, lambda p: (p * 2,), (tf.constant(1, tf.int64),))
    return p


def _pairwise_row_sums(x: tf.Tensor) -> tf.Tensor:
    """Row sums of ``x`` ``[rows, width]`` in a fixed order: zero-pad to a power-of-two width,
    then add adjacent columns (0+1, 2+3, ...) until one is left."""
    width = tf.shape(x, out_type=tf.int64)[1]
    x = tf.pad(x, [[0, 0], [0, _pow2_ceil(width) - width]])

    def halve(s: tf.Tensor) -> tuple[tf.Tensor]:
        shape = tf.shape(s)
        pairs = tf.reshape(s, [shape[0], shape[1] // 2, 2])
        return (pairs[:, :, 0] + pairs[:, :, 1],)

    (s,) = tf.while_loop(
        lambda s: tf.shape(s)[1] > 1,
        halve,
        (x,),
        shape_invariants=(tf.TensorShape([None, None]),),
    )
    return s[:, 0]


def bucket_norms(buckets: tf.Tensor) -> tf.Tensor:
    """float32 L2 norms of the rows of ``buckets`` (float32), summed in float64 pairwise."""
    squares = tf.square(tf.cast(buckets, tf.float64))
    return tf.cast(tf.sqrt(_pairwise_row_sums(squares)), tf.float32)


def qsgd_quantize(
    tensor: tf.Tensor, levels: int, bucket_size: int, seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Reference QSGD quantizer: ``(signed_levels, norms)``; see the module docstring."""
    flat = tf.cast(tf.reshape(tensor, [-1]), tf.float32)
    n = tf.size(flat)
    b = bucket_size if bucket_size > 0 else tf.maximum(n, 1)
    buckets = _bucketed(flat, b)
    norms = bucket_norms(buckets)
    safe = tf.where(norms > 0, norms, tf.ones_like(norms))
    ratio = tf.abs(buckets) / safe[:, None] * float(levels)
    ratio = tf.reshape(ratio, [-1])[:n]
    floor = tf.floor(ratio)
    up = tf.cast(hash_uniform(seed, n) < ratio - floor, tf.float32)
    level = tf.minimum(floor + up, float(levels))
    signed = tf.where(flat < 0, -level, level)
    # NaN (a NaN entry, or Inf / Inf in a bucket holding Inf) has no integer value: level 0.
    signed = tf.where(tf.math.is_nan(signed), tf.zeros_like(signed), signed)
    return tf.cast(signed, level_dtype(levels)), norms


def qsgd_dequantize(
    signed_levels: tf.Tensor,
    norms: tf.Tensor,
    levels: int,
    bucket_size: int,
    shape: tf.TensorShape | list[int],
    dtype: tf.DType,
) -> tf.Tensor:
    """Reference QSGD decoder: ``norm_bucket * signed_level / levels`` in ``dtype``."""
    q = tf.cast(signed_levels, tf.float32)
    n = tf.size(q)
    b = bucket_size if bucket_size > 0 else tf.maximum(n, 1)
    scaled = _bucketed(q, b) * (norms[:, None] / float(levels))
    return tf.cast(tf.reshape(tf.reshape(scaled, [-1])[:n], shape), dtype)
