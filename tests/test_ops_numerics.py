"""The ops' numerical policies and argument bounds, on every CPU-side path.

Denormals are read as zero and flushed (TensorFlow's CPU policy, x86 DAZ/FTZ: a result is
flushed when, rounded with an unbounded exponent, it is below the smallest normal); QSGD
saturates near float32's maximum; bucket_size is clamped to n; k and the index dtype are
checked. The compiled CPU kernel, the pure-TF reference and the NumPy model agree bit for bit;
the CUDA core's explicit flush functions (tfs_common.h) are compiled for the host and compared
with TensorFlow's CPU arithmetic.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify.ops as ops
from tests.dtypes import DTYPES, KIND, UINT
from tf_sparsify.ops import pure_tf as reference
from tf_sparsify.ops.paths import SOURCE_DIR
from tf_sparsify.testing import numpy_reference as npref

TINY32 = 2.0**-126
# A float32 exactly in the band the flush rule decides: its IEEE (gradual) rounding at the
# denormal boundary is FLT_MIN, its rounding with an unbounded exponent is below FLT_MIN.
BELOW_TINY = TINY32 * (1 - 2.0**-24)


@pytest.fixture(autouse=True)
def _require_compiled():
    if not ops.is_compiled():
        if os.environ.get(ops.REQUIRE_ENV) == "1":
            pytest.fail(f"compiled ops required but unavailable: {ops.info().reason}")
        pytest.skip(f"compiled ops unavailable: {ops.info().reason}")


def bits_of(t: tf.Tensor) -> np.ndarray:
    return tf.bitcast(t, UINT[t.dtype.size]).numpy()


def make(x, dtype: tf.DType) -> tf.Tensor:
    """float64 values rounded to ``dtype`` (no flush: the inputs keep their denormals)."""
    x = np.asarray(x, np.float64)
    if dtype == tf.bfloat16:
        return tf.bitcast(tf.constant(npref.f32_to_bf16(x.astype(np.float32))), tf.bfloat16)
    return tf.constant(x.astype(dtype.as_numpy_dtype))


def assert_same(actual: tf.Tensor, expected: np.ndarray | tf.Tensor, what: str) -> None:
    a = bits_of(actual) if actual.dtype.is_floating else actual.numpy()
    if isinstance(expected, tf.Tensor):
        expected = bits_of(expected) if expected.dtype.is_floating else expected.numpy()
    np.testing.assert_array_equal(a.ravel(), np.asarray(expected).ravel(), err_msg=what)


def check_topk(grad: tf.Tensor, residual: tf.Tensor, k: int) -> tuple[tf.Tensor, ...]:
    got = ops.topk_error_feedback(grad, residual, k)
    ev, ei, er = npref.topk_error_feedback(bits_of(grad), bits_of(residual), k, KIND[grad.dtype])
    for name, g, e, r in zip(
        ("values", "indices", "new_residual"),
        got,
        (ev, ei, er),
        reference.topk_error_feedback(grad, residual, k),
        strict=True,
    ):
        assert_same(g, e, f"{name} vs NumPy")
        assert_same(g, r, f"{name} vs reference")
    return got


def check_qsgd(x: tf.Tensor, levels: int, bucket_size: int, seed: int) -> tuple[tf.Tensor, ...]:
    """Quantize and dequantize on the three paths; returns (levels, norms, decoded)."""
    q, norms = ops.qsgd_quantize(x, levels, bucket_size, seed)
    eq, en = npref.qsgd_quantize(bits_of(x), KIND[x.dtype], levels, bucket_size, seed)
    rq, rn = reference.qsgd_quantize(x, levels, bucket_size, tf.constant(seed, tf.int64))
    assert_same(q, eq, "levels vs NumPy")
    assert_same(q, rq, "levels vs reference")
    assert_same(norms, en.view(np.uint32), "norms vs NumPy")
    assert_same(norms, rn, "norms vs reference")
    out = ops.qsgd_dequantize(q, norms, levels, bucket_size, x.shape, x.dtype)
    e_out = npref.qsgd_dequantize(eq, en, levels, bucket_size, KIND[x.dtype])
    r_out = reference.qsgd_dequantize(rq, rn, levels, bucket_size, x.shape, x.dtype)
    assert_same(out, e_out, "decoded vs NumPy")
    assert_same(out, r_out, "decoded vs reference")
    return q, norms, out


def denormal(dtype: tf.DType) -> float:
    """A denormal of ``dtype`` (a quarter of its smallest normal)."""
    return float(ml_dtypes.finfo(dtype.as_numpy_dtype).tiny) / 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_denormal_policy(dtype):
    """Issue 12's example: grad [0, d, 0, 0], residual 0, k = 1 with d denormal."""
    d = denormal(dtype)
    zeros = make(np.zeros(4), dtype)
    values, indices, new_residual = check_topk(make([0, d, 0, 0], dtype), zeros, 1)
    if dtype == tf.float16:  # computed in float32, where float16 denormals are normal
        assert indices.numpy().tolist() == [1] and float(values[0]) == d
    else:
        assert indices.numpy().tolist() == [0] and float(values[0]) == 0.0
        assert not tf.reduce_any(new_residual != 0)
    tiny = float(ml_dtypes.finfo(dtype.as_numpy_dtype).tiny)
    rng = np.random.default_rng(5)
    g = rng.choice([d, -d, tiny * 1.5, -tiny, 0.0, -0.0, 1.0], 999)
    r = rng.choice([d, -d, tiny, -tiny * 1.5, 0.0, -0.0], 999)
    for k in (1, 50, 500):
        check_topk(make(g, dtype), make(r, dtype), k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_sum_denormal_policy(dtype):
    """Denormal values read as zero and denormal sums (1.5 tiny - tiny) flush, in the middle
    of three duplicates too; float16 keeps both. Inf + -Inf, NaN and signed zeros as on CPU."""
    d = denormal(dtype)
    tiny = float(ml_dtypes.finfo(dtype.as_numpy_dtype).tiny)
    values = [d, -d, 1.5 * tiny, -tiny, 1.5 * tiny, -tiny, tiny, np.inf, -np.inf, np.nan, -0.0]
    indices = [0, 1, 2, 2, 3, 3, 3, 4, 4, 5, 6]
    v = make(values, dtype)
    got = ops.scatter_sum(v, tf.constant(indices), 8)
    expected = npref.scatter_sum(bits_of(v), np.array(indices), 8, KIND[dtype])
    assert_same(got, expected, "vs NumPy")
    assert_same(got, reference.scatter_sum(v, tf.constant(indices), 8), "vs reference")
    out = tf.cast(got, tf.float64).numpy()
    if dtype == tf.float16:
        assert out[:4].tolist() == [d, -d, 0.5 * tiny, 1.5 * tiny]
    else:
        assert out[:4].tolist() == [0.0, 0.0, 0.0, tiny] and not np.signbit(out[:2]).any()
    assert np.isnan(out[4:6]).all() and out[6] == 0 and not np.signbit(out[6])
    rng = np.random.default_rng(8)
    many = make(rng.choice([d, -d, tiny * 1.5, -tiny, 0.0, -0.0, 1.0], 999), dtype)
    idx = rng.integers(0, 50, 999)
    got = ops.scatter_sum(many, tf.constant(idx), 50)
    assert_same(got, npref.scatter_sum(bits_of(many), idx, 50, KIND[dtype]), "random vs NumPy")
    assert_same(got, reference.scatter_sum(many, tf.constant(idx), 50), "random vs reference")


@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_denormal_inputs(dtype):
    """A bucket of denormals has norm 0 and levels 0 (float16: kept, computed in float32);
    denormals beside normal values get level 0 without disturbing the norm."""
    d = denormal(dtype)
    tiny = float(ml_dtypes.finfo(dtype.as_numpy_dtype).tiny)
    x = np.array([d, -d, d, -d, 1.0, d, -2.0, -d, tiny, tiny * 3, -tiny, tiny * 2])
    q, norms, _ = check_qsgd(make(x, dtype), 7, 4, 11)
    if dtype == tf.float16:
        assert float(norms[0]) == pytest.approx(2 * d)
    else:
        assert float(norms[0]) == 0.0 and not q.numpy()[:4].any()
        assert float(norms[1]) == pytest.approx(np.sqrt(5.0))
    assert q.numpy()[5] == 0 and q.numpy()[7] == 0


def test_flush_rule_float64_input_band():
    """float64 inputs just below float32's smallest normal: those that round (with an
    unbounded exponent) below it become 0, the rest become FLT_MIN."""
    x = make(
        [TINY32 * (1 - 2.0**-24.5), TINY32 * (1 - 2.0**-26), -TINY32 * (1 - 2.0**-24)], tf.float64
    )
    _, norms, _ = check_qsgd(x, 4, 1, 3)
    assert norms.numpy().tolist() == [0.0, TINY32, 0.0]


def test_flush_rule_dequantize_scale_band():
    """norm / levels exactly 2^-126 (1 - 2^-24) flushes to zero; exactly 2^-126 does not."""
    norms = tf.constant([BELOW_TINY * 4, TINY32 * 4], tf.float32)
    q = tf.constant([4, 4], tf.int8)
    out = ops.qsgd_dequantize(q, norms, 4, 1, [2], tf.float32)
    expected = npref.qsgd_dequantize(q.numpy(), norms.numpy(), 4, 1, "float32")
    assert_same(out, expected, "decoded vs NumPy")
    assert_same(out, reference.qsgd_dequantize(q, norms, 4, 1, [2], tf.float32), "vs reference")
    assert out.numpy().tolist() == [0.0, 4 * TINY32]


def test_flush_rule_quantize_ratio_band():
    """|x| / norm exactly in the band flushes to 0, so with u = 0 (seed 1, index 1) the level
    stays 0 instead of rounding up."""
    assert npref.hash_uniform(1, 2)[1] == 0.0
    x = make([2.0**26, BELOW_TINY * 2.0**26], tf.float32)
    q, norms, _ = check_qsgd(x, 3, 0, 1)
    assert float(norms[0]) == 2.0**26 and q.numpy()[1] == 0


def _host_flush_library(tmp_path: Path) -> ctypes.CDLL:
    """tfs_common.h's flush functions compiled for the host, run with FTZ/DAZ off."""
    source = tmp_path / "flush.cc"
    source.write_text(
        '#include <xmmintrin.h>\n#include "tfs_common.h"\n'
        "struct Ieee { unsigned s = _mm_getcsr(); Ieee() { _mm_setcsr(s & ~0x8040u); }"
        " ~Ieee() { _mm_setcsr(s); } };\n"
        'extern "C" {\n'
        "float divide_ftz(float a, float b) { Ieee i; return tfs::DivideFtz(a, b); }\n"
        "float input64(double x) { Ieee i; return tfs::QsgdInput(x); }\n"
        "float input32(float x) { Ieee i; return tfs::QsgdInput(x); }\n"
        "float norm(double s) { Ieee i; return tfs::NormFromSumOfSquares(s); }\n}\n"
    )
    lib_path = tmp_path / "flush.so"
    cxx = os.environ.get("CXX", "g++")
    cmd = [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off"]
    cmd += [f"-I{SOURCE_DIR / 'include'}", str(source), "-o", str(lib_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))
    f32, f64 = ctypes.c_float, ctypes.c_double
    for name, args in (("divide_ftz", [f32, f32]), ("input64", [f64]), ("input32", [f32])):
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = f32
    lib.norm.argtypes, lib.norm.restype = [f64], f32
    return lib


def _f32_bits(values) -> np.ndarray:
    return np.asarray(values, np.float32).view(np.uint32)


def test_cuda_flush_emulation_matches_tensorflow_cpu(tmp_path):
    """What the CUDA core computes with explicit flushes equals TensorFlow's CPU hardware
    (DAZ/FTZ) and the NumPy model, bit for bit, across the band below FLT_MIN."""
    lib = _host_flush_library(tmp_path)
    rng = np.random.default_rng(12)
    b = np.repeat(rng.uniform(1, 2, 64).astype(np.float32), 81)
    near = (b * np.float32(TINY32)).view(np.uint32).astype(np.int64)
    a = (near + np.tile(np.arange(-40, 41), 64)).astype(np.uint32).view(np.float32)  # +-40 ulps
    a = np.concatenate([a, [BELOW_TINY, -BELOW_TINY, TINY32, 0.0, 3.0]]).astype(np.float32)
    b = np.concatenate([b, [1.0, 1.0, 1.0, 1.0, 7.0]]).astype(np.float32)
    hardware = tf.math.divide(tf.constant(a), tf.constant(b)).numpy()
    emulated = [lib.divide_ftz(float(x), float(y)) for x, y in zip(a, b, strict=True)]
    np.testing.assert_array_equal(_f32_bits(emulated), _f32_bits(hardware))
    np.testing.assert_array_equal(_f32_bits(npref.divide(a, b)), _f32_bits(hardware))
    assert (hardware == 0).any() and (np.abs(hardware) == np.float32(TINY32)).any()

    d = TINY32 * (1 - np.arange(-64, 64) * 2.0**-28)
    d = np.concatenate([d, -d, [2.0**-1030, 1.0, 1e-300]])
    hardware = tf.cast(tf.constant(d), tf.float32).numpy()
    emulated = [lib.input64(float(v)) for v in d]
    np.testing.assert_array_equal(_f32_bits(emulated), _f32_bits(hardware))
    bits = npref.qsgd_input(d.view(np.uint64), "float64")
    np.testing.assert_array_equal(_f32_bits(bits), _f32_bits(hardware))
    big = [1e300, -1e39, np.inf, -np.inf, float(np.finfo(np.float64).max)]
    assert [lib.input64(v) for v in big] == [3.4028234663852886e38, -3.4028234663852886e38] + [
        np.inf,
        -np.inf,
        3.4028234663852886e38,
    ]
    assert np.isnan(lib.input64(np.nan)) and lib.input32(2.0**-140) == 0.0
    assert lib.norm(1e78) == np.float32(3.4028234663852886e38) and lib.norm(np.inf) == np.inf


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bucket_size", [0, 2, 3])
def test_qsgd_saturates_near_the_maximum(dtype, bucket_size):
    """Finite inputs near the dtype's maximum give finite norms and finite decoded values."""
    top = float(ml_dtypes.finfo(dtype.as_numpy_dtype).max)
    x = make([top, top, -top, 1.0, top / 3, -top], dtype)
    q, norms, out = check_qsgd(x, 5, bucket_size, 17)
    assert np.isfinite(norms.numpy()).all() and np.isfinite(tf.cast(out, tf.float64)).all()
    assert np.abs(tf.cast(out, tf.float64).numpy()).max() <= top
    if dtype in (tf.float32, tf.float64) and bucket_size == 0:
        assert float(norms[0]) == float(np.finfo(np.float32).max)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 19, 300])
def test_qsgd_dequantize_float16_conversion(n):
    """The float16 decoder (F16C where the CPU has it, in 8-wide steps plus a tail) rounds and
    saturates as the references, and keeps NaN norms' NaNs with their signs."""
    q = tf.constant(np.arange(n) % 255 - 127, tf.int8)
    buckets = npref.num_buckets(n, 5)
    norms = np.resize(np.array([np.nan, -np.nan, 1e30, 2.0, 3e-3], np.float32), buckets)
    out = ops.qsgd_dequantize(q, tf.constant(norms), 127, 5, [n], tf.float16)
    assert_same(out, npref.qsgd_dequantize(q.numpy(), norms, 127, 5, "float16"), "vs NumPy")
    ref = reference.qsgd_dequantize(q, tf.constant(norms), 127, 5, [n], tf.float16)
    assert_same(out, ref, "vs reference")


EXTREME_BUCKETS = [2**31, 2**40, 2**62, 2**62 + 1, 2**63 - 1]


@pytest.mark.parametrize("n", [0, 1, 10, 1000])
@pytest.mark.parametrize("bucket_size", EXTREME_BUCKETS)
def test_qsgd_bucket_size_clamped_to_n(n, bucket_size):
    """Any bucket_size >= n means one bucket: identical to bucket_size 0, no huge buffers."""
    x = make(np.random.default_rng(n).standard_normal(n), tf.float32)
    q, norms, out = check_qsgd(x, 4, bucket_size, 2)
    q0, norms0 = ops.qsgd_quantize(x, 4, 0, 2)
    assert_same(q, q0, "levels")
    assert_same(norms, norms0, "norms")
    assert norms.shape == [min(n, 1)]
    raw = ops._library().module
    rq, rnorms = raw.qsgd_quantize(
        x, tf.constant(2, tf.int64), levels=4, bucket_size=bucket_size, out_type=tf.int8
    )
    assert_same(rq, q0, "raw op levels")
    spec = tf.TensorSpec([n], tf.float32)
    traced = tf.function(lambda v: ops.qsgd_quantize(v, 4, bucket_size, 2)).get_concrete_function(
        spec
    )
    assert traced.structured_outputs[1].shape == [min(n, 1)]


@pytest.mark.parametrize("k", [True, False, 1.0, np.float32(2.0), np.bool_(True), "3"])
def test_topk_k_must_be_an_integer(k):
    g = tf.zeros([10])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"k must be an integer, got k = "):
        ops.topk_error_feedback(g, g, k)


@pytest.mark.parametrize("k", [tf.constant(2.0), tf.constant(True), tf.constant([1, 2])])
def test_topk_k_tensor_must_be_an_int_scalar(k):
    g = tf.zeros([10])
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="k must be (an int32 or int64 scalar|a scalar)"
    ):
        ops.topk_error_feedback(g, g, k)


def test_topk_index_dtype_is_consistent():
    """int32 eagerly and in a tf.function of unknown shape, on both paths; int64 on request."""
    g = make(np.random.default_rng(3).standard_normal(300), tf.float32)
    r = tf.zeros_like(g)
    spec = [tf.TensorSpec([None], tf.float32)] * 2
    eager = ops.topk_error_feedback(g, r, 7)[1]
    traced = tf.function(lambda a, b: ops.topk_error_feedback(a, b, 7), input_signature=spec)
    ref = tf.function(lambda a, b: reference.topk_error_feedback(a, b, 7), input_signature=spec)
    wide = ops.topk_error_feedback(g, r, 7, index_dtype=tf.int64)[1]
    assert eager.dtype == traced(g, r)[1].dtype == ref(g, r)[1].dtype == tf.int32
    assert wide.dtype == tf.int64 and wide.numpy().tolist() == eager.numpy().tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(
            tf.errors.InvalidArgumentError, match="index_dtype must be int32 or int64"
        ):
            ops.topk_error_feedback(g, r, 7, index_dtype=tf.int16)


def test_topk_two_to_the_31_elements_run_on_cpu_with_int64_indices():
    """Traced only (no 8 GB allocation): int64 indices, the op pinned to the CPU kernel, and
    int32 indices refused with a clear error."""
    spec = tf.TensorSpec([2**31], tf.float32)
    fn = tf.function(lambda g: ops.topk_error_feedback(g, g, 5))
    graph = fn.get_concrete_function(spec).graph
    (node,) = [op for op in graph.get_operations() if op.type == "TopKErrorFeedback"]
    assert "CPU" in node.device and node.outputs[1].dtype == tf.int64
    narrow = tf.function(lambda g: ops.topk_error_feedback(g, g, 5, index_dtype=tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError, match="int32 cannot index 2147483648"):
        narrow.get_concrete_function(spec)
