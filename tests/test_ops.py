"""Custom ops against NumPy and the pure-TF reference: TopK with error feedback, QSGD and
ScatterSum.

Inputs travel as raw bit patterns so every comparison is bit for bit; the NumPy model follows
the ops' denormal policy (that of TensorFlow's CPU threads). Tests of the compiled kernels
skip when the library is absent, and fail instead under ``TF_SPARSIFY_REQUIRE_OPS=1``.
"""

from __future__ import annotations

import os
import re
import warnings

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify.ops as ops
from tests.conftest import run_python
from tests.dtypes import DTYPES, KIND, UINT
from tf_sparsify.__main__ import main
from tf_sparsify.ops import dispatch, library
from tf_sparsify.ops import pure_tf as reference
from tf_sparsify.testing import numpy_reference as npref


@pytest.fixture
def available():
    """The ops as dispatched (compiled, else the reference); fails when compiled ones are
    required but missing."""
    if not ops.is_compiled() and os.environ.get(ops.REQUIRE_ENV) == "1":
        pytest.fail(f"compiled ops required but unavailable: {ops.info().reason}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def bits_of(t: tf.Tensor) -> np.ndarray:
    return tf.bitcast(t, UINT[t.dtype.size]).numpy()


def tensor_of(bits: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    return tf.bitcast(tf.constant(bits), dtype)


def from_f64(x: np.ndarray, dtype: tf.DType) -> np.ndarray:
    """float64 values rounded to ``dtype``, as bit patterns."""
    kind = KIND[dtype]
    if kind == "float64":
        return x.astype(np.float64).view(np.uint64)
    if kind == "float16":
        return x.astype(np.float16).view(np.uint16)
    return npref.from_f32(x.astype(np.float32), kind)


def make(x: np.ndarray, dtype: tf.DType) -> tf.Tensor:
    return tensor_of(from_f64(x, dtype), dtype)


def assert_bits_equal(actual: tf.Tensor, expected: np.ndarray | tf.Tensor, what: str) -> None:
    a = bits_of(actual) if actual.dtype.is_floating else actual.numpy()
    e = expected if isinstance(expected, np.ndarray) else bits_of(expected)
    np.testing.assert_array_equal(a.ravel(), e.ravel(), err_msg=what)


def check_topk(grad: tf.Tensor, residual: tf.Tensor, k: int, what: str = "") -> None:
    """The op equals the NumPy model and, bit for bit, the TF reference."""
    values, indices, new_residual = ops.topk_error_feedback(grad, residual, k)
    kind = KIND[grad.dtype]
    ev, ei, er = npref.topk_error_feedback(bits_of(grad), bits_of(residual), k, kind)
    assert new_residual.shape == grad.shape and new_residual.dtype == grad.dtype
    assert indices.dtype == tf.int32 and values.shape == [k]
    np.testing.assert_array_equal(indices.numpy(), ei, err_msg=f"indices {what}")
    assert_bits_equal(values, ev, f"values {what}")
    assert_bits_equal(new_residual, er, f"new_residual {what}")
    rv, ri, rr = reference.topk_error_feedback(grad, residual, k)
    np.testing.assert_array_equal(indices.numpy(), ri.numpy(), err_msg=f"ref indices {what}")
    assert_bits_equal(values, rv, f"ref values {what}")
    assert_bits_equal(new_residual, rr, f"ref residual {what}")


RNG = np.random.default_rng(1234)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1023, 100003])
def test_topk_random(available, dtype, n):
    g, r = make(RNG.standard_normal(n), dtype), make(RNG.standard_normal(n), dtype)
    for k in sorted({0, 1, max(n // 1000, 1), max(n // 100, 1), n // 8, n // 8 + 1, n}):
        check_topk(g, r, k, f"n={n} k={k}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_ties(available, dtype):
    n = 70001
    zeros = make(np.zeros(n), dtype)
    for value in (0.0, -0.0, 1.5):
        for k in (1, 5, n // 10, n // 2, n - 1, n):
            check_topk(make(np.full(n, value), dtype), zeros, k, f"all {value} k={k}")
    few = make(RNG.integers(-3, 4, n).astype(np.float64), dtype)
    for k in (1, 100, n // 16, n // 7, n // 3):
        check_topk(few, zeros, k, f"few values k={k}")
    signed_zeros = make(np.where(RNG.random(n) < 0.5, -0.0, 0.0), dtype)
    check_topk(signed_zeros, zeros, 10, "signed zeros")
    check_topk(signed_zeros, signed_zeros, 10, "signed zeros sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_extremes_and_nan(available, dtype):
    n = 4099
    info = ml_dtypes.finfo(dtype.as_numpy_dtype)
    x = RNG.standard_normal(n)
    x[::7] *= float(info.max) / 4
    x[3::11] = float(info.tiny) / 8  # denormal (flushed for float32/64 and bfloat16)
    x[5::13] = -float(info.tiny) / 2
    x[1::17] = np.inf
    x[2::19] = -np.inf
    x[4::23] = np.nan
    g = make(x, dtype)
    r = make(RNG.standard_normal(n) * 1e-3, dtype)
    nans = int(np.isnan(x).sum())
    for k in (1, 10, nans, 500, 1000):
        check_topk(g, r, k, f"extremes k={k}")
    values, _, new_residual = ops.topk_error_feedback(g, r, nans)
    assert np.isnan(tf.cast(values, tf.float64).numpy()).all(), "NaN ranks highest"
    assert not np.isnan(tf.cast(new_residual, tf.float64).numpy()).any()


BF16_INF, BF16_NAN = 0x7F80, 0x7FC0
SIGN16 = 0x8000


@pytest.mark.parametrize("n", [8, 40, 4099])
def test_topk_bfloat16_nan_bits_follow_one_rule(available, n):
    """A bfloat16 NaN made in float32 (Inf + -Inf, a NaN operand) is 0x7FC0 with its sign on
    every path and at every length (TensorFlow's Cast drops the sign from about 16 elements)."""
    g, r = from_f64(RNG.standard_normal(n), tf.bfloat16), from_f64(np.zeros(n), tf.bfloat16)
    g[1::7], r[1::7] = BF16_INF, BF16_INF | SIGN16  # Inf + -Inf: x86's negative NaN
    g[2::7], g[3::7] = BF16_NAN | SIGN16, BF16_NAN
    r[4::7] = (BF16_INF + 1) | SIGN16  # a signalling NaN, quieted
    nans = sum(len(range(start, n, 7)) for start in (1, 2, 3, 4))
    grad, residual = tensor_of(g, tf.bfloat16), tensor_of(r, tf.bfloat16)
    for k in (nans - 1, nans + 2):
        check_topk(grad, residual, k, f"k={k}")
    values = bits_of(ops.topk_error_feedback(grad, residual, nans)[0])
    assert set(values) == {BF16_NAN, BF16_NAN | SIGN16}


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_topk_paths(available, dtype):
    """Cases that defeat the sampled fast path or need several radix levels."""
    n = 1 << 18
    base = np.abs(RNG.standard_normal(n)) * 1e-3
    under = base.copy()
    under[::64] = 100 + RNG.random(n // 64)  # the samples see only large values
    over = 1 + RNG.random(n)
    over[::64] = 1e-6  # the samples see only small values
    narrow = 1 + RNG.random(n) / 32  # one top digit, distinct lower digits
    zeros = make(np.zeros(n), dtype)
    for name, x in (("under", under), ("over", over), ("narrow", narrow)):
        for k in (1000, n // 8, n // 8 + 1, n // 2):
            check_topk(make(x, dtype), zeros, k, f"{name} k={k}")


@pytest.mark.parametrize("shape", [[3, 5, 7], [2, 1, 4096], [1]])
def test_topk_rank(available, shape):
    n = int(np.prod(shape))
    g = make(RNG.standard_normal(shape), tf.float32)
    r = make(RNG.standard_normal(shape), tf.float32)
    check_topk(g, r, max(n // 10, 1))


def test_topk_in_place_residual(available):
    """A forwardable residual is reused; the caller's tensors are never modified."""
    n, k = 200003, 2000
    g = make(RNG.standard_normal(n), tf.float32)
    r = make(RNG.standard_normal(n), tf.float32)
    before = r.numpy().copy()
    ops.topk_error_feedback(g, r, k)
    np.testing.assert_array_equal(r.numpy(), before)

    def steps(fn):
        def body(i, res, total):
            v, idx, res = fn(g, res, k)
            return i + 1, res, total + tf.reduce_sum(tf.cast(idx, tf.int64))

        return tf.while_loop(lambda i, *_: i < 3, body, (0, r * 1.0, tf.constant(0, tf.int64)))

    got = tf.function(lambda: steps(ops.topk_error_feedback))()
    want = tf.function(lambda: steps(reference.topk_error_feedback))()
    assert_bits_equal(got[1], want[1], "residual after 3 steps")
    assert int(got[2]) == int(want[2])
    np.testing.assert_array_equal(r.numpy(), before)


def test_topk_tf_function_dynamic(compiled):
    """Unknown static shape: int32 indices as in eager mode; a bad runtime k fails in the kernel."""
    f = tf.function(
        lambda g, r, k: ops.topk_error_feedback(g, r, k),
        input_signature=[tf.TensorSpec([None], tf.float32)] * 2 + [tf.TensorSpec([], tf.int32)],
    )
    g, r = make(RNG.standard_normal(999), tf.float32), make(RNG.standard_normal(999), tf.float32)
    values, indices, new_residual = f(g, r, tf.constant(50))
    rv, ri, rr = reference.topk_error_feedback(g, r, 50)
    assert indices.dtype == tf.int32 and ri.dtype == tf.int32
    np.testing.assert_array_equal(indices.numpy(), ri.numpy())
    assert_bits_equal(values, rv, "values")
    assert_bits_equal(new_residual, rr, "residual")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be in \[0, 999\].*1000"):
        f(g, r, tf.constant(1000))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "n,levels,bucket_size",
    [
        (0, 4, 0),
        (1, 1, 0),
        (7, 127, 3),
        (1023, 128, 0),
        (1023, 32767, 512),
        (100003, 4, 512),
        (100003, 15, 0),
        (5000, 3, 7),
        (5000, 2, 9000),
    ],
)
def test_qsgd_matches_references(available, dtype, n, levels, bucket_size):
    x = make(RNG.standard_normal(n) * 3, dtype)
    for seed in (0, -7, 2**40 + 12345):
        q, norms = ops.qsgd_quantize(x, levels, bucket_size, seed)
        eq, en = npref.qsgd_quantize(bits_of(x), KIND[dtype], levels, bucket_size, seed)
        rq, rn = reference.qsgd_quantize(x, levels, bucket_size, tf.constant(seed, tf.int64))
        assert q.dtype == reference.level_dtype(levels) and q.shape == [n]
        np.testing.assert_array_equal(q.numpy(), eq)
        np.testing.assert_array_equal(q.numpy(), rq.numpy())
        assert_bits_equal(norms, en.view(np.uint32), "norms vs numpy")
        assert_bits_equal(norms, rn, "norms vs reference")
        out = ops.qsgd_dequantize(q, norms, levels, bucket_size, x.shape, dtype)
        ref_out = reference.qsgd_dequantize(rq, rn, levels, bucket_size, x.shape, dtype)
        assert out.dtype == dtype and out.shape == x.shape
        assert_bits_equal(out, ref_out, "dequantized vs reference")
        assert_bits_equal(
            out, npref.qsgd_dequantize(eq, en, levels, bucket_size, KIND[dtype]), "vs np"
        )


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_special_values(available, dtype):
    info = ml_dtypes.finfo(dtype.as_numpy_dtype)
    x = RNG.standard_normal(3000)
    x[::10] = 0.0
    x[1::10] = -0.0
    x[2::97] = float(info.tiny) / 4
    x[3::101] = float(info.max) / 2
    x[4::503] = np.nan
    x[5::607] = -np.inf
    t = make(x, dtype)
    for bucket_size in (0, 64, 100):
        q, norms = ops.qsgd_quantize(t, 8, bucket_size, 99)
        rq, rn = reference.qsgd_quantize(t, 8, bucket_size, tf.constant(99, tf.int64))
        np.testing.assert_array_equal(q.numpy(), rq.numpy())
        assert_bits_equal(norms, rn, "norms")
        eq, en = npref.qsgd_quantize(bits_of(t), KIND[dtype], 8, bucket_size, 99)
        np.testing.assert_array_equal(q.numpy(), eq)
        assert_bits_equal(norms, en.view(np.uint32), "norms vs numpy")


@pytest.mark.parametrize("n", [4, 19, 300])
def test_qsgd_dequantize_bfloat16_nan_bits_follow_one_rule(available, n):
    """Decoding to bfloat16, the NaNs of an Inf bucket norm (0 * Inf) and of NaN norms keep
    their signs on every path and at every length; nonzero levels saturate."""
    q = tf.constant(np.arange(n) % 5 - 2, tf.int8)
    norms = np.resize(np.array([np.inf, np.nan, -np.nan, 2.0], np.float32), npref.num_buckets(n, 3))
    out = ops.qsgd_dequantize(q, tf.constant(norms), 4, 3, [n], tf.bfloat16)
    want = npref.qsgd_dequantize(q.numpy(), norms, 4, 3, "bfloat16")
    assert_bits_equal(out, want, "vs NumPy")
    ref = reference.qsgd_dequantize(q, tf.constant(norms), 4, 3, [n], tf.bfloat16)
    assert_bits_equal(out, ref, "vs reference")
    zero_times_inf = npref.f32_to_bf16(np.float32(0) * np.float32(np.inf))
    assert bits_of(out)[2] == zero_times_inf and bits_of(out)[0] == 0xFF7F  # -bfloat16 max
    if n > 9:  # the NaN norms' NaNs, each with its sign
        assert set(bits_of(out)[3:6]) == {BF16_NAN} and set(bits_of(out)[6:9]) == {
            BF16_NAN | SIGN16
        }


def test_qsgd_unbiased_and_rank(available):
    x = make(RNG.standard_normal([4, 5, 6]), tf.float32)
    seeds = range(400)
    decoded = [
        ops.qsgd_dequantize(*ops.qsgd_quantize(x, 2, 16, s), 2, 16, x.shape, tf.float32)
        for s in seeds
    ]
    mean = tf.reduce_mean(tf.stack(decoded), axis=0)
    np.testing.assert_allclose(mean.numpy(), x.numpy(), atol=0.25)
    assert decoded[0].shape == x.shape


def test_qsgd_tf_function_dynamic(available):
    f = tf.function(
        lambda x, s: ops.qsgd_quantize(x, 4, 0, s),
        input_signature=[tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([], tf.int64)],
    )
    x = make(RNG.standard_normal([10, 3]), tf.float32)
    q, norms = f(x, tf.constant(5, tf.int64))
    rq, rn = reference.qsgd_quantize(x, 4, 0, tf.constant(5, tf.int64))
    np.testing.assert_array_equal(q.numpy(), rq.numpy())
    assert_bits_equal(norms, rn, "norms")
    shape = tf.constant([10, 3])
    out = tf.function(lambda q, nr: ops.qsgd_dequantize(q, nr, 4, 0, shape, tf.float16))(q, norms)
    assert out.shape == [10, 3] and out.dtype == tf.float16


def test_invalid_arguments(available):
    g = tf.zeros([10])
    bad = tf.errors.InvalidArgumentError
    with pytest.raises(bad, match=r"k must be in \[0, 10\].*k = -1"):
        ops.topk_error_feedback(g, g, -1)
    with pytest.raises(bad, match=r"k must be in \[0, 10\].*k = 11"):
        ops.topk_error_feedback(g, g, 11)
    with pytest.raises(bad, match="residual must have grad's shape"):
        ops.topk_error_feedback(g, tf.zeros([11]), 1)
    with pytest.raises(bad, match="residual must have grad's dtype float32, got float64"):
        ops.topk_error_feedback(g, tf.zeros([10], tf.float64), 1)
    with pytest.raises(bad, match="grad must be float16, bfloat16, float32 or float64, got int32"):
        ops.topk_error_feedback(tf.zeros([10], tf.int32), tf.zeros([10], tf.int32), 1)
    with pytest.raises(bad, match="levels must be an int in"):
        ops.qsgd_quantize(g, 0, 0, 1)
    with pytest.raises(bad, match="levels = 40000"):
        ops.qsgd_quantize(g, 40000, 0, 1)
    with pytest.raises(bad, match=r"bucket_size must be an int in \[0, 2\*\*63\).*-1"):
        ops.qsgd_quantize(g, 4, -1, 1)
    with pytest.raises(bad, match=r"bucket_size must be an int in \[0, 2\*\*63\).*2\.0"):
        ops.qsgd_quantize(g, 4, 2.0, 1)
    with pytest.raises(bad, match=r"bucket_size must be an int in \[0, 2\*\*63\)"):
        ops.qsgd_quantize(g, 4, 2**63, 1)
    q, norms = ops.qsgd_quantize(g, 4, 3, 1)
    with pytest.raises(bad, match="signed_levels must be int16 for levels = 200"):
        ops.qsgd_dequantize(q, norms, 200, 3, [10], tf.float32)
    with pytest.raises(bad, match="norms must be a vector of 4 bucket norms"):
        ops.qsgd_dequantize(q, norms[:3], 4, 3, [10], tf.float32)
    with pytest.raises(bad, match=r"shape \[11\] has 11 elements but signed_levels has 10"):
        ops.qsgd_dequantize(q, norms, 4, 3, [11], tf.float32)


def test_qsgd_seed_integer_dtypes_agree(available):
    x = make(RNG.standard_normal(50), tf.float32)
    want, _ = ops.qsgd_quantize(x, 4, 0, tf.constant(7, tf.int64))
    for seed in (7, np.int32(7), tf.constant(7), tf.constant(7, tf.uint8)):
        np.testing.assert_array_equal(ops.qsgd_quantize(x, 4, 0, seed)[0].numpy(), want.numpy())


@pytest.mark.parametrize(
    "seed", [tf.constant(1.5), 1.5, np.float64(2.0), True, tf.constant(True), "1"]
)
def test_qsgd_seed_must_be_an_integer(available, seed):
    """A float seed is refused, not truncated (1.5 would quantize as seed 1)."""
    message = rf"seed must be an integer scalar, got seed = {re.escape(repr(seed))} \(dtype"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        ops.qsgd_quantize(tf.zeros([10]), 4, 0, seed)


@pytest.mark.parametrize("num_elements", [2**64, 2**63, -1, 1.5, None])
def test_index_code_num_elements_bounds(available, num_elements):
    message = rf"num_elements must be an int in \[0, 2\*\*63\), got {re.escape(repr(num_elements))}"
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        ops.encode_indices(tf.constant([1, 5]), num_elements)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        ops.decode_indices(tf.zeros([1], tf.uint8), num_elements, 2)


PACKED_SHAPES, PACKED_KS = [(4, 5), (6,)], [3, 2]


@pytest.mark.parametrize(
    "values, shapes, ks, message",
    [
        (
            tf.zeros([2, 5]),
            PACKED_SHAPES[:1],
            PACKED_KS,
            r"ks must have one k per shape \(len\(shapes\) = 1\), got len\(ks\) = 2: "
            r"ks = \[3, 2\]",
        ),
        (
            tf.zeros([2, 5]),
            [(4, None), (6,)],
            PACKED_KS,
            r"shapes\[0\] must be fully defined, got \(4, None\)",
        ),
        (
            tf.zeros([2, 5], tf.int32),
            PACKED_SHAPES,
            PACKED_KS,
            "values must be float16, bfloat16, float32 or float64, got int32",
        ),
        (
            tf.zeros([2, 10]),
            PACKED_SHAPES,
            [3, 7],
            r"ks\[1\] must be an int in \[0, 6\] \(shapes\[1\] = \(6,\)\), got 7",
        ),
        (
            tf.zeros([2, 5]),
            PACKED_SHAPES,
            [3, 2.0],
            r"ks\[1\] must be an int in \[0, 6\] \(shapes\[1\] = \(6,\)\), got 2\.0",
        ),
        (
            tf.zeros([2, 4]),
            PACKED_SHAPES,
            PACKED_KS,
            r"values must be \[replicas, sum\(ks\) = 5\], got \(2, 4\)",
        ),
    ],
    ids=["ks per shape", "None in a shape", "int32 values", "k above n", "float k", "columns"],
)
def test_packed_decompress_sum_bad_arguments(available, values, shapes, ks, message):
    code = tf.zeros([2, 4], tf.uint8)
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        ops.packed_decompress_sum(values, code, shapes, ks, 0.5)


def test_kernel_validation(compiled):
    """The kernels check their arguments themselves (the raw ops skip the Python checks)."""
    g = tf.zeros([6])
    bad = tf.errors.InvalidArgumentError
    with pytest.raises(bad, match=r"TopKErrorFeedback: k must be in \[0, 6\].*k = 7"):
        compiled.top_k_error_feedback(g, g, 7)
    with pytest.raises(bad, match="TopKErrorFeedback: k must be in.*k = -2"):
        compiled.top_k_error_feedback(g, g, -2)
    with pytest.raises(bad, match="residual must have the shape of grad"):
        compiled.top_k_error_feedback(g, tf.zeros([2, 3]), 1)
    with pytest.raises(bad, match="levels must be in \\[1, 32767\\], got levels = 0"):
        compiled.qsgd_quantize(
            g, tf.constant(1, tf.int64), levels=0, bucket_size=0, out_type=tf.int8
        )
    with pytest.raises(bad, match="bucket_size must be >= 0.*-3"):
        compiled.qsgd_quantize(
            g, tf.constant(1, tf.int64), levels=3, bucket_size=-3, out_type=tf.int8
        )
    q = tf.zeros([6], tf.int8)
    with pytest.raises(bad, match="norms must be a vector of 2 bucket norms"):
        compiled.qsgd_dequantize(q, tf.zeros([3]), [6], levels=4, bucket_size=3, dtype=tf.float32)
    with pytest.raises(bad, match=r"shape \[7\] has 7 elements but signed_levels has 6"):
        compiled.qsgd_dequantize(q, tf.zeros([2]), [7], levels=4, bucket_size=3, dtype=tf.float32)
    with pytest.raises(bad, match="levels = 300 needs signed levels of type int16"):
        compiled.qsgd_quantize(
            g, tf.constant(1, tf.int64), levels=300, bucket_size=0, out_type=tf.int8
        )


def check_scatter(values: tf.Tensor, indices: tf.Tensor, n: int, what: str = "") -> tf.Tensor:
    """The op equals the NumPy model and, bit for bit, the TF reference."""
    got = ops.scatter_sum(values, indices, n)
    assert got.dtype == values.dtype and got.shape == [n]
    expected = npref.scatter_sum(bits_of(values), indices.numpy(), n, KIND[values.dtype])
    assert_bits_equal(got, expected, f"vs NumPy {what}")
    assert_bits_equal(got, reference.scatter_sum(values, indices, n), f"vs reference {what}")
    return got


def replicas_indices(n: int, k: int, replicas: int, dtype: tf.DType) -> tf.Tensor:
    """Each replica's k ascending distinct indices, concatenated (a gathered TopK payload)."""
    parts = [np.sort(RNG.choice(n, k, replace=False)) for _ in range(replicas)]
    return tf.constant(np.concatenate(parts), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
@pytest.mark.parametrize("n", [1, 7, 1000, 3 * 2**15 + 5, 100003])
def test_scatter_sum_matches_references(available, dtype, index_dtype, n):
    for m in sorted({1, max(n // 100, 1), n, 3 * n}):
        values = make(RNG.standard_normal(m), dtype)
        indices = tf.constant(RNG.integers(0, n, m), index_dtype)
        check_scatter(values, indices, n, f"m={m}")
    k = max(n // 100, 1)
    values = make(RNG.standard_normal(2 * k), dtype)
    check_scatter(values, replicas_indices(n, k, 2, index_dtype), n, "2 replicas")


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_sum_adds_duplicates_in_input_order(available, dtype):
    """(1 + e) + e rounds to 1 with e half an ulp of 1 (e + e + 1 would not), at the ends of
    the output and of its 2^15-entry blocks, among random duplicates elsewhere."""
    eps = float(ml_dtypes.finfo(dtype.as_numpy_dtype).eps)
    n = 2 * 2**15 + 3
    spots = np.array([0, 2**15 - 1, 2**15, n - 1])
    others = np.setdiff1d(np.arange(n), spots)
    noise = RNG.standard_normal(400)
    x = np.concatenate(
        [np.ones(4), noise[:200], np.full(4, eps / 2), noise[200:], np.full(4, eps / 2)]
    )
    idx = np.concatenate([spots, RNG.choice(others, 200), spots, RNG.choice(others, 200), spots])
    got = check_scatter(make(x, dtype), tf.constant(idx), n)
    assert tf.cast(tf.gather(got, spots), tf.float64).numpy().tolist() == [1.0] * spots.size


def test_scatter_sum_empty_and_zero_sized(available):
    for dtype in DTYPES:
        empty = make(np.zeros(0), dtype)
        for index_dtype in (tf.int32, tf.int64):
            none = tf.zeros([0], index_dtype)
            assert_bits_equal(check_scatter(empty, none, 5), np.zeros(5, np.uint8), "m=0")
            assert check_scatter(empty, none, 0).shape == [0]
    zeros = check_scatter(make(np.array([-0.0, -0.0]), tf.float32), tf.constant([1, 1]), 3)
    assert_bits_equal(zeros, np.zeros(3, np.uint32), "0 + -0 is +0")


def test_scatter_sum_tf_function_unknown_shapes(available):
    spec = [tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.int64)]
    dynamic = tf.function(
        lambda v, i, n: ops.scatter_sum(v, i, n),
        input_signature=[*spec, tf.TensorSpec([], tf.int32)],
    )
    static = tf.function(lambda v, i: ops.scatter_sum(v, i, 50), input_signature=spec)
    assert static.get_concrete_function().structured_outputs.shape == [50]
    values = make(RNG.standard_normal(30), tf.float32)
    indices = tf.constant(RNG.integers(0, 50, 30))
    want = reference.scatter_sum(values, indices, 50)
    assert_bits_equal(dynamic(values, indices, tf.constant(50)), want, "n as a tensor")
    assert_bits_equal(static(values, indices), want, "n static")
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"indices\[\d+\] = \d+ is out of"):
        dynamic(values, indices, tf.constant(10))


def test_scatter_sum_gradient(available):
    values = make(RNG.standard_normal(6), tf.float32)
    indices = tf.constant([4, 0, 4, 2, 9, 0])
    weights = make(RNG.standard_normal(10), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(values)
        loss = tf.reduce_sum(ops.scatter_sum(values, indices, 10) * weights)
    np.testing.assert_array_equal(tape.gradient(loss, values), tf.gather(weights, indices))


@pytest.mark.parametrize(
    "args,message",
    [
        (([1.0, 2.0], [0], 3), r"indices must have the length of values \(2\), got 1"),
        (([[1.0]], [[0]], 3), r"values must be a vector, got shape \(1, 1\)"),
        (([1.0], [[0]], 3), r"indices must be a vector, got shape \(1, 1\)"),
        (([1.0], [0], -1), r"n must be an int in \[0, 2\*\*63\), got n = -1"),
        (([1.0], [0], 2.0), "n must be an integer, got n = 2.0"),
        (([1.0], [0], True), "n must be an integer, got n = True"),
        (([1.0], [0], tf.constant([3])), "n must be a scalar"),
        (([1.0], [0], tf.constant(3.0)), "n must be an int32 or int64 scalar, got dtype float"),
        (([1.0], [0.0], 3), "indices must be int32 or int64, got float32"),
        (([1], [0], 3), "values must be float16, bfloat16, float32 or float64, got int32"),
        (([1.0, 2.0], [0, 3], 3), r"ScatterSum: indices\[1\] = 3 is out of range \[0, 3\)"),
        (([1.0, 2.0], [-1, 3], 3), r"ScatterSum: indices\[0\] = -1 is out of range \[0, 3\)"),
        (([1.0], [0], 0), r"ScatterSum: indices\[0\] = 0 is out of range \[0, 0\)"),
    ],
)
def test_scatter_sum_bad_arguments(available, args, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        ops.scatter_sum(*args)


def test_scatter_sum_reference_names_the_bad_index():
    """The fallback's own range check (the segment sum drops negative indices silently)."""
    values, n = tf.constant([1.0, 2.0, 3.0]), tf.constant(4, tf.int64)
    for indices, bad in (([0, 4, 1], r"indices\[1\] = 4"), ([0, 1, -2], r"indices\[2\] = -2")):
        with pytest.raises(
            tf.errors.InvalidArgumentError, match=bad + r" is out of range \[0, 4\)"
        ):
            reference.scatter_sum(values, tf.constant(indices), n)


def test_scatter_sum_kernel_validation(compiled):
    """The kernel checks its arguments itself (the raw op skips the Python checks)."""
    v = tf.constant([1.0, 2.0])
    n = tf.constant(4, tf.int64)
    bad = tf.errors.InvalidArgumentError
    with pytest.raises(bad, match=r"ScatterSum: indices must have the length of values \(2\)"):
        compiled.scatter_sum(v, tf.constant([0]), n)
    with pytest.raises(bad, match="ScatterSum: values must be a vector"):
        compiled.scatter_sum(tf.constant([[1.0]]), tf.constant([0]), n)
    with pytest.raises(bad, match="ScatterSum: n must be >= 0, got n = -2"):
        compiled.scatter_sum(v, tf.constant([0, 1]), tf.constant(-2, tf.int64))
    with pytest.raises(bad, match="ScatterSum: n must be a scalar"):
        compiled.scatter_sum(v, tf.constant([0, 1]), tf.constant([4], tf.int64))
    with pytest.raises(bad, match=r"ScatterSum: indices\[1\] = 2147483647 is out of range"):
        compiled.scatter_sum(v, tf.constant([0, 2**31 - 1]), n)
    with pytest.raises(bad, match=r"ScatterSum: indices\[0\] = -4 is out of range \[0, 4\)"):
        compiled.scatter_sum(v, tf.constant([-4, 0], tf.int64), n)


def test_saved_model_round_trip(available, tmp_path):
    class Compress(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([64], tf.float32)] * 2)
        def topk(self, g, r):
            return ops.topk_error_feedback(g, r, 5)

        @tf.function(input_signature=[tf.TensorSpec([64], tf.float32)])
        def qsgd(self, x):
            q, norms = ops.qsgd_quantize(x, 4, 16, tf.constant(3, tf.int64))
            return q, norms, ops.qsgd_dequantize(q, norms, 4, 16, [64], tf.float32)

    module = Compress()
    tf.saved_model.save(module, str(tmp_path))
    loaded = tf.saved_model.load(str(tmp_path))
    g, r = make(RNG.standard_normal(64), tf.float32), make(RNG.standard_normal(64), tf.float32)
    for got, want in zip(loaded.topk(g, r), module.topk(g, r), strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    for got, want in zip(loaded.qsgd(g), module.qsgd(g), strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_saved_model_loads_in_fresh_process(compiled, tmp_path):
    """Importing tf_sparsify.ops registers the ops, so a SavedModel using them loads."""

    class Compress(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([8], tf.float32)])
        def topk(self, g):
            return ops.topk_error_feedback(g, tf.zeros_like(g), 2)[1]

    tf.saved_model.save(Compress(), str(tmp_path))
    code = (
        "import tensorflow as tf, tf_sparsify.ops\n"
        f"m = tf.saved_model.load({str(tmp_path)!r})\n"
        "print(m.topk(tf.constant([1., -5., 2., 0., 7., -1., 3., 0.])).numpy().tolist())"
    )
    assert run_python(code, timeout=120).strip().endswith("[1, 4]")


def test_fallback_warns_once(monkeypatch):
    monkeypatch.setattr(ops, "_library", lambda: library.Library(None, "pretend it is missing"))
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.delenv(ops.REQUIRE_ENV, raising=False)
    g, r = make(RNG.standard_normal(50), tf.float32), make(RNG.standard_normal(50), tf.float32)
    with pytest.warns(RuntimeWarning, match="pretend it is missing"):
        values, indices, _ = ops.topk_error_feedback(g, r, 4)
    rv, ri, _ = reference.topk_error_feedback(g, r, 4)
    np.testing.assert_array_equal(indices.numpy(), ri.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.qsgd_quantize(g, 4, 0, 1)
    assert not ops.is_compiled() and "NOT loaded" in str(ops.info())
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be in"):
        ops.topk_error_feedback(g, r, 51)
    monkeypatch.setenv(ops.REQUIRE_ENV, "1")
    with pytest.raises(RuntimeError, match="TF_SPARSIFY_REQUIRE_OPS=1.*pretend it is missing"):
        ops.topk_error_feedback(g, r, 4)


def _op_types(fn, *specs) -> set[str]:
    graph = tf.function(fn).get_concrete_function(*specs).graph
    return {op.type for op in graph.get_operations()}


def test_the_packages_loader_hooks_are_dispatchs(monkeypatch):
    """``ops._library``, ``ops._compiled`` and ``ops._warned``, which tests replace, read and
    write those of tf_sparsify.ops.dispatch, where every op's one choice is made."""
    assert ops._library is dispatch.loaded_library
    assert ops._compiled is dispatch.compiled_module
    assert ops._warned is dispatch.warned
    spec = tf.TensorSpec([50], tf.float32)

    def topk(g):
        return ops.topk_error_feedback(g, tf.zeros_like(g), 3)

    original = dispatch.compiled_module
    monkeypatch.setattr(ops, "_compiled", lambda: None)
    assert dispatch.compiled_module is not original
    assert "TopKErrorFeedback" not in _op_types(topk, spec)  # the reference
    monkeypatch.setattr(ops, "_library", lambda: library.Library(None, "pretend it is missing"))
    monkeypatch.setattr(ops, "_warned", True)
    assert dispatch.warned and not ops.is_compiled()
    monkeypatch.undo()
    assert dispatch.compiled_module is original and ops._compiled is original
    assert dispatch.loaded_library().module is ops._library().module
    if ops.is_compiled():
        assert "TopKErrorFeedback" in _op_types(topk, spec)


def test_a_kernel_that_does_not_take_the_inputs_leaves_the_library_alone(monkeypatch):
    """float64 casts run the reference without asking for the library: no error under
    TF_SPARSIFY_REQUIRE_OPS=1 with the library missing, no warning."""
    monkeypatch.setattr(ops, "_library", lambda: library.Library(None, "pretend it is missing"))
    monkeypatch.setattr(ops, "_warned", False)
    monkeypatch.setenv(ops.REQUIRE_ENV, "1")
    g = make(RNG.standard_normal(50), tf.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wire, residual = ops.saturating_cast_feedback(g, tf.zeros_like(g), tf.bfloat16)
    want = reference.saturating_cast_feedback(g, tf.zeros_like(g), tf.bfloat16)
    np.testing.assert_array_equal(bits_of(wire), bits_of(want[0]))
    np.testing.assert_array_equal(residual.numpy(), want[1].numpy())
    with tf.device("/CPU:0"), pytest.raises(RuntimeError, match="TF_SPARSIFY_REQUIRE_OPS=1"):
        ops.saturating_cast_feedback(tf.cast(g, tf.float32), None, tf.bfloat16)


def test_library_built_from_older_sources_is_not_used(compiled, monkeypatch):
    """A library lacking an op (built before it existed) says so and how to rebuild."""
    older = type("OlderOps", (), {"TopKErrorFeedback": None, "ScatterSum": None})
    monkeypatch.setattr(library.tf, "load_op_library", lambda path: older)
    loaded = library.load()
    assert loaded.module is None
    assert "lacks QSGDQuantize, QSGDDequantize, IndexCodeEncode, IndexCodeDecode" in loaded.reason
    assert "python -m tf_sparsify.ops.build" in loaded.reason


def test_info_and_cli(compiled, capsys):
    report = ops.info()
    assert report.compiled and set(report.kernels) == set(library.OP_NAMES)
    assert all("CPU" in devices for devices in report.kernels.values()), report.kernels
    assert main(["info"]) == 0  # python -m tf_sparsify info
    out = capsys.readouterr().out
    assert "TopKErrorFeedback: CPU" in out
    assert "CUDA:" in out and "driver:" in out


def test_build_reports_missing_compiler(monkeypatch, capsys):
    from tf_sparsify.ops import build

    monkeypatch.setenv("CXX", "/nonexistent/g++")
    assert build.main([]) == 1
    assert "C++ compiler '/nonexistent/g++' not found" in capsys.readouterr().err
