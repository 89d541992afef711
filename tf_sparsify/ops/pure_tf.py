"""Pure-TensorFlow reference implementations of the custom ops.

These define the semantics the compiled kernels must reproduce bit for bit:

* ``topk_error_feedback``: ``acc = grad + residual`` (in the input dtype); the k entries of
  largest magnitude are selected by the sign-masked IEEE bit pattern of ``acc`` (monotone in
  ``|acc|``; NaN ranks above +Inf, +0.0 and -0.0 are equal), ties go to the lowest flat index;
  ``indices`` are returned in ascending order, ``values = acc[indices]``, ``new_residual`` is
  ``acc`` with the selected entries set to zero.
* ``qsgd_quantize``: per bucket of ``bucket_size`` consecutive flat entries (the whole tensor
  when ``bucket_size`` is 0 or at least n), ``norm = ||x_bucket||_2`` rounded to float32 (at
  most float32's max), its sum of squares taken in float64 in a fixed order (the bucket
  zero-padded to a power of two, adjacent pairs added level by level) so that every
  implementation gets the same bits; ``r = |x| / norm * levels``,
  ``level = floor(r) + (u < r - floor(r))`` with ``u = hash_uniform(seed, flat_index)``,
  capped at ``levels``; the payload is ``sign(x) * level`` as int8 (levels <= 127) or int16
  (0 where the level is NaN), plus the float32 norms.
* ``scatter_sum``: ``dense[j]`` is the sum of the ``values[i]`` with ``indices[i] == j`` (0
  elsewhere), duplicates added in input order with the dtype's addition;
  ``tf.math.unsorted_segment_sum`` does exactly that on CPU. An index outside ``[0, n)`` is an
  InvalidArgumentError (under XLA, which cannot raise errors at run time, it is dropped).
* ``hash_uniform``: a counter-based uniform in [0, 1) shared with the kernels, so the compiled
  QSGD and this reference give identical payloads for the same seed.
* ``saturating_cast_feedback``: ``v = grad + residual`` (``grad`` alone without a residual),
  ``wire = saturating_cast(v, wire_dtype)``, ``new_residual = v - float(wire)``;
  ``wire_to_float``: ``float(wire) * scale`` and whether every entry of ``wire`` is finite.
* ``wire_sum``: the rows of ``[P, ...]`` float16/bfloat16 added in float32 from +0.0 in rank
  order, rounded once to the dtype (Inf beyond its range, NaN as one quiet NaN); one row as it
  is.

Numerics shared by every path (CPU kernel, CUDA core, this reference on CPU, NumPy model):

* Denormals: float32 and float64 arithmetic (and bfloat16's, done in float32) reads denormal
  inputs as zero and flushes denormal results to zero, keeping the sign, as TensorFlow's CPU
  kernels do (x86 DAZ/FTZ; a result is flushed when, rounded to the type's precision with an
  unbounded exponent, it is below the smallest normal). float16 is computed in float32, where
  its denormals are normal numbers, so they are kept, as in TensorFlow. TensorFlow's CPU
  kernels flush in hardware; the flushes written out here make the reference follow the same
  policy on devices that keep denormals.
* QSGD saturates instead of overflowing: finite inputs beyond float32's range count as
  +-float32 max, bucket norms above float32 max are sent as float32 max (levels are capped at
  ``levels``), and decoded values are clamped to the output dtype's largest finite magnitude.
  Finite inputs thus never give Inf or NaN; Inf and NaN inputs keep their documented effect.
* bfloat16 results computed in float32 (TopK's ``grad + residual``, QSGD's decoded values) are
  rounded to nearest even, and a NaN becomes the quiet NaN with its sign: 0x7FC0 or 0xFFC0
  (x86 makes Inf + -Inf and 0 * Inf negative NaNs; :func:`from_float32`), where ``tf.cast``
  gives 0x7FC0 or 0xFFC0 depending on the tensor's length. On a GPU, QSGD's NaNs carry the
  GPU's own bits.
"""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.ops import qsgd_buckets
from tf_sparsify.ops.xla import in_xla_context

_MASKS = {
    tf.float16: (tf.int16, 0x7FFF),
    tf.bfloat16: (tf.int16, 0x7FFF),
    tf.float32: (tf.int32, 0x7FFFFFFF),
    tf.float64: (tf.int64, 0x7FFFFFFFFFFFFFFF),
}
MAX_INT32_ELEMENTS = 2**31 - 1
F32_TINY = 2.0**-126
F32_MAX = 3.4028234663852886e38
# Exact values whose float32 rounding with an unbounded exponent is below F32_TINY lie below
# this bound; they flush to zero (x86's FTZ rule).
F32_FLUSH_BELOW = F32_TINY * (1 - 2.0**-25)
# Largest finite magnitude of each output dtype, as float32.
OUTPUT_MAX = {
    tf.float16: 65504.0,
    tf.bfloat16: 3.3895313892515355e38,
    tf.float32: F32_MAX,
    tf.float64: F32_MAX,
}


def index_dtype(num_elements: int | None) -> tf.DType:
    """int32 indices while they fit (and for an unknown size), int64 beyond."""
    return tf.int64 if num_elements is not None and num_elements > MAX_INT32_ELEMENTS else tf.int32


def magnitude_key(x: tf.Tensor) -> tf.Tensor:
    """Sign-masked bit pattern of ``x`` as a signed integer, monotone in ``|x|``."""
    int_dtype, mask = _MASKS[x.dtype]
    key = tf.bitwise.bitwise_and(tf.bitcast(x, int_dtype), tf.constant(mask, int_dtype))
    # top_k has no int16 kernel; widening keeps the order.
    return tf.cast(key, tf.int32) if int_dtype == tf.int16 else key


def flush(x: tf.Tensor) -> tf.Tensor:
    """Denormals of a float32/float64 tensor replaced by zeros of the same sign."""
    tiny = x.dtype.as_numpy_dtype(F32_TINY if x.dtype == tf.float32 else 2.0**-1022)
    return tf.where(tf.abs(x) < tiny, x * 0, x)


def from_float32(x: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """float32 ``x`` rounded to ``dtype`` (nearest even); in bfloat16 a NaN is 0x7FC0 with
    ``x``'s sign bit, as the kernels (Eigen's scalar conversion) and the NumPy model give it,
    where TensorFlow's Cast gives 0x7FC0 for every NaN of a long enough tensor."""
    if dtype != tf.bfloat16:
        return tf.cast(x, dtype)
    negative = tf.bitcast(x, tf.int32) < 0
    quiet = tf.where(negative, tf.constant(0xFFC0, tf.uint16), tf.constant(0x7FC0, tf.uint16))
    return tf.where(tf.math.is_nan(x), tf.bitcast(quiet, tf.bfloat16), tf.cast(x, tf.bfloat16))


def add(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """``a + b`` under the denormal policy (16-bit types add in float32, then round)."""
    if a.dtype == tf.float16:
        return a + b
    if a.dtype == tf.bfloat16:
        s = flush(flush(tf.cast(a, tf.float32)) + flush(tf.cast(b, tf.float32)))
        return from_float32(s, tf.bfloat16)
    return flush(flush(a) + flush(b))


def divide(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    """float32 ``a / b`` (normal or zero operands, ``b > 0``) whose result is flushed by the
    FTZ rule: when its exact value is below ``F32_FLUSH_BELOW`` in magnitude.

    The quotient is taken in float64 and rounded once, which is float32's correctly rounded
    quotient, also where XLA turns a division by a constant into a product with its inverse
    (a float32 inverse would round differently)."""
    wide_a, wide_b = tf.cast(a, tf.float64), tf.cast(b, tf.float64)
    q = tf.cast(wide_a / wide_b, tf.float32)
    exact_below = tf.abs(wide_a) < wide_b * F32_FLUSH_BELOW
    small = (tf.abs(q) < F32_TINY) | ((tf.abs(q) == F32_TINY) & exact_below)
    return tf.where(small, q * 0, q)


def to_float32(x: tf.Tensor) -> tf.Tensor:
    """QSGD's input conversion: denormals flushed, finite values beyond float32's range
    saturated to +-float32 max, float64 rounded by the FTZ rule."""
    if x.dtype == tf.float16:
        return tf.cast(x, tf.float32)
    if x.dtype != tf.float64:
        return flush(tf.cast(x, tf.float32))
    y = tf.cast(
        tf.where(tf.math.is_finite(x), tf.clip_by_value(x, -F32_MAX, F32_MAX), x), tf.float32
    )
    return tf.where(tf.abs(x) < F32_FLUSH_BELOW, y * 0, y)


def topk_error_feedback(
    grad: tf.Tensor, residual: tf.Tensor, k: int | tf.Tensor, index_type: tf.DType | None = None
) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Reference for the fused op: ``(values, indices, new_residual)``."""
    acc = add(grad, residual)
    flat = tf.reshape(acc, [-1])
    index_type = index_type or index_dtype(flat.shape[0])
    keys = magnitude_key(flat)
    if index_type == tf.int32 and flat.shape[0] is None:
        n = tf.size(flat, out_type=tf.int64)
        check = tf.debugging.assert_less_equal(
            n,
            tf.constant(MAX_INT32_ELEMENTS, tf.int64),
            message="TopKErrorFeedback: index_type int32 cannot index this many elements; "
            "use index_dtype=tf.int64",
        )
        with tf.control_dependencies([check]):
            keys = tf.identity(keys)
    picked = _top_k_indices(flat, keys, k, index_type)
    indices = tf.sort(picked)
    values = tf.gather(flat, indices)
    new_flat = tf.tensor_scatter_nd_update(flat, tf.expand_dims(indices, 1), tf.zeros_like(values))
    return values, indices, tf.reshape(new_flat, tf.shape(acc))


def _top_k_indices(
    flat: tf.Tensor, keys: tf.Tensor, k: int | tf.Tensor, index_type: tf.DType
) -> tf.Tensor:
    """The indices of the ``k`` largest ``keys`` (:func:`magnitude_key` of ``flat``), ties to
    the lowest index.

    Under XLA, whose top-k sorts integer keys whole (25x slower than its float32 top-k on CPU),
    16- and 32-bit tensors rank their magnitudes as float32 instead: the same order, ties
    included, for every value but NaN (which the integer keys rank above Inf, and a float
    top-k may not), so a tensor holding a NaN still takes the integer keys.
    """
    if not in_xla_context() or flat.dtype == tf.float64:
        return tf.math.top_k(keys, k=k, sorted=True, index_type=index_type).indices
    magnitudes = tf.abs(tf.cast(flat, tf.float32))
    return tf.cond(
        tf.reduce_any(tf.math.is_nan(magnitudes)),
        lambda: tf.math.top_k(keys, k=k, sorted=True, index_type=index_type).indices,
        lambda: tf.math.top_k(magnitudes, k=k, sorted=True, index_type=index_type).indices,
    )


def scatter_sum(values: tf.Tensor, indices: tf.Tensor, n: int | tf.Tensor) -> tf.Tensor:
    """Reference ScatterSum: ``tf.math.unsorted_segment_sum`` (input order on CPU) after a range
    check naming the first index outside ``[0, n)`` (the segment sum drops negative ones). XLA
    has no run-time checks (nor string ops for the message): there the sum alone."""
    n = tf.cast(n, tf.int64)
    if in_xla_context():
        return tf.math.unsorted_segment_sum(values, indices, n)
    wide = tf.cast(indices, tf.int64)
    bad = tf.logical_or(wide < 0, wide >= n)
    # A sentinel entry keeps argmax and gather valid when there are no indices.
    first = tf.argmax(tf.concat([tf.cast(bad, tf.int32), [1]], 0), output_type=tf.int64)
    value = tf.gather(tf.concat([wide, [0]], 0), first)
    message = tf.strings.format(
        "ScatterSum: indices[{}] = {} is out of range [0, {})", (first, value, n)
    )
    check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(bad)), [message])
    with tf.control_dependencies([check]):
        return tf.math.unsorted_segment_sum(values, indices, n)


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


def _size(x: tf.Tensor) -> int | tf.Tensor:
    """The number of elements of ``x``: a Python int when its shape is static (always under
    XLA, which needs pad widths and slice bounds as constants), else an int32 tensor."""
    n = x.shape.num_elements()
    return tf.size(x) if n is None else n


def effective_bucket(n: int | tf.Tensor, bucket_size: int) -> int | tf.Tensor:
    """Bucket length: ``min(bucket_size, n)``, the whole tensor for 0 (at least 1); a Python
    int for a Python ``n``, else int64."""
    if isinstance(n, int):
        return qsgd_buckets.effective_bucket(n, bucket_size)
    n = tf.maximum(tf.cast(n, tf.int64), 1)
    return n if bucket_size == 0 else tf.minimum(tf.constant(bucket_size, tf.int64), n)


def _bucketed(flat: tf.Tensor, b: int | tf.Tensor) -> tf.Tensor:
    """The vector ``flat`` zero-padded to whole buckets of ``b``, shape ``[num_buckets, b]``."""
    if isinstance(b, int):  # static sizes
        return tf.reshape(tf.pad(flat, [[0, -_size(flat) % b]]), [-1, b])
    n = tf.size(flat, out_type=tf.int64)
    pad = (-n) % b
    return tf.reshape(tf.pad(flat, [[0, pad]]), tf.stack([-1, b]))


def _pow2_ceil(x: tf.Tensor) -> tf.Tensor:
    """Smallest power of two >= ``x`` (an int64 scalar >= 1)."""
    (p,) = tf.while_loop(lambda p: p < x, lambda p: (p * 2,), (tf.constant(1, tf.int64),))
    return p


def _halve(s: tf.Tensor) -> tuple[tf.Tensor]:
    """Adjacent columns of ``s`` ``[rows, even width]`` added: 0+1, 2+3, ..."""
    shape = tf.shape(s)
    pairs = tf.reshape(s, [shape[0], shape[1] // 2, 2])
    return (pairs[:, :, 0] + pairs[:, :, 1],)


def _pairwise_row_sums(x: tf.Tensor) -> tf.Tensor:
    """Row sums of ``x`` ``[rows, width]`` in a fixed order: zero-pad to a power-of-two width,
    then add adjacent columns (0+1, 2+3, ...) until one is left (unrolled for a static width,
    in a while loop otherwise)."""
    width = x.shape[1]
    if width is not None:
        x = tf.pad(x, [[0, 0], [0, (1 << (width - 1).bit_length()) - width]])
        while x.shape[1] > 1:
            (x,) = _halve(x)
        return x[:, 0]
    width = tf.shape(x, out_type=tf.int64)[1]
    x = tf.pad(x, [[0, 0], [0, _pow2_ceil(width) - width]])
    (s,) = tf.while_loop(
        lambda s: tf.shape(s)[1] > 1,
        _halve,
        (x,),
        shape_invariants=(tf.TensorShape([None, None]),),
    )
    return s[:, 0]


def bucket_norms(buckets: tf.Tensor) -> tf.Tensor:
    """float32 L2 norms of the rows of ``buckets`` (float32), summed in float64 pairwise, at
    most float32's max when the sum is finite."""
    norms = tf.sqrt(_pairwise_row_sums(tf.square(tf.cast(buckets, tf.float64))))
    return tf.cast(
        tf.where(tf.math.is_finite(norms), tf.minimum(norms, F32_MAX), norms), tf.float32
    )


def qsgd_quantize(
    tensor: tf.Tensor, levels: int, bucket_size: int, seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """Reference QSGD quantizer: ``(signed_levels, norms)``; see the module docstring."""
    flat = to_float32(tf.reshape(tensor, [-1]))
    n = _size(flat)
    buckets = _bucketed(flat, effective_bucket(n, bucket_size))
    norms = bucket_norms(buckets)
    safe = tf.where(norms > 0, norms, tf.ones_like(norms))
    ratio = divide(tf.abs(buckets), safe[:, None]) * float(levels)
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
    """Reference QSGD decoder: ``signed_level * (norm_bucket / levels)`` in float32, clamped to
    ``dtype``'s largest finite magnitude, then rounded to ``dtype``."""
    q = tf.cast(signed_levels, tf.float32)
    n = _size(q)
    scale = divide(flush(norms), tf.constant(float(levels)))
    scaled = _bucketed(q, effective_bucket(n, bucket_size)) * scale[:, None]
    top = OUTPUT_MAX[tf.as_dtype(dtype)]
    clamped = tf.where(scaled > top, top, tf.where(scaled < -top, -top, scaled))
    return from_float32(tf.reshape(tf.reshape(clamped, [-1])[:n], shape), dtype)


def sparse_sgd_apply(
    variable: tf.Variable,
    values: tf.Tensor,
    indices: tf.Tensor,
    scale: tf.Tensor,
    learning_rate: tf.Tensor,
) -> None:
    """SparseSgdApply's steps: row after row, ``flat[indices[r]] -= (values[r] * scale) *
    learning_rate`` (indices are checked only by TensorFlow's scatter)."""

    def row_step(flat: tf.Tensor, row: tuple[tf.Tensor, tf.Tensor]) -> tf.Tensor:
        row_values, row_indices = row
        return tf.tensor_scatter_nd_sub(
            flat, row_indices[:, None], (row_values * scale) * learning_rate
        )

    flat = tf.reshape(tf.convert_to_tensor(variable), [-1])
    flat = tf.foldl(row_step, (values, indices), initializer=flat)
    variable.assign(tf.reshape(flat, variable.shape))


def saturating_cast(tensor: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``tensor`` rounded to ``dtype``; finite values beyond its range become its largest finite
    value (not Inf), Inf and NaN stay as they are."""
    biggest = dtype.max
    saturated = tf.clip_by_value(tensor, -biggest, biggest)  # NaN stays NaN
    return tf.cast(tf.where(tf.math.is_inf(tensor), tensor, saturated), dtype)


def saturating_cast_feedback(
    grad: tf.Tensor, residual: tf.Tensor | None, wire_dtype: tf.DType
) -> tuple[tf.Tensor, tf.Tensor | None]:
    """Reference for the fused cast: ``(wire, new_residual)``, ``new_residual`` None without a
    residual."""
    v = flush(grad) if residual is None else add(grad, residual)
    wire = saturating_cast(v, wire_dtype)
    if wire_dtype == tf.bfloat16:  # TensorFlow's Cast gives 0x7FC0 or 0xFFC0: pin 0x7FC0
        quiet_nan = tf.bitcast(tf.constant(0x7FC0, tf.uint16), tf.bfloat16)
        wire = tf.where(tf.math.is_nan(v), quiet_nan, wire)
    if residual is None:
        return wire, None
    return wire, flush(v - tf.cast(wire, v.dtype))


def wire_to_float(wire: tf.Tensor, scale: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Reference for the fused decoder: ``(float32(wire) * scale, all finite)``."""
    product = flush(flush(tf.cast(wire, tf.float32)) * scale)
    return product, tf.reduce_all(tf.math.is_finite(wire))


def wire_sum(gathered: tf.Tensor) -> tf.Tensor:
    """Reference for WireSum: the sum of ``gathered``'s rows in its 16-bit dtype."""
    rows = tf.cast(gathered, tf.float32)
    one_row = tf.shape(rows)[0] == 1  # reduce_sum returns one row as it is
    total = tf.foldl(
        lambda acc, row: tf.where(one_row, row, add(acc, row)),
        rows,
        initializer=tf.zeros(tf.shape(rows)[1:]),
    )
    quiet_nan = 0x7E00 if gathered.dtype == tf.float16 else 0x7FC0
    nan = tf.bitcast(tf.constant(quiet_nan, tf.uint16), gathered.dtype)
    return tf.where(tf.math.is_nan(total), nan, tf.cast(total, gathered.dtype))
