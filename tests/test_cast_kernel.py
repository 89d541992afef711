"""The fused 16-bit cast with error feedback (SaturatingCastFeedback): bit for bit against the
NumPy model on both kernel paths (F16C / AVX512-BF16 where the CPU has them, and the portable
path forced, so both are pinned on every machine) and on the pure-TF reference."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.ops import pure_tf
from tf_sparsify.testing import numpy_reference as ref

WIRES = {"float16": tf.float16, "bfloat16": tf.bfloat16}
F32_BITS = [
    0x00000000, 0x80000000,  # signed zeros
    0x00000001, 0x80000001, 0x00400000, 0x807FFFFF,  # float32 denormals: read as zero
    0x00800000, 0x80800000,  # smallest normal
    0x33000000, 0x33000001, 0x33C00000, 0x337FFFFF,  # float16 subnormal ties: 2^-25, 3 * 2^-25
    0x387FC000, 0x387FE000, 0x38800000,  # around float16's smallest normal
    0x3F801000, 0x3F803000, 0x3F801001,  # float16 ties at 1 (to even, down and up)
    0x3F808000, 0x3F818000, 0x3F808001,  # bfloat16 ties at 1
    0x477FEFFF, 0x477FF000, 0xC77FF000, 0x49742400,  # float16 saturation: 65520 and 1e6
    0x7F7F7FFF, 0x7F7F8000, 0xFF7FFFFF,  # bfloat16 saturation
    0x7F800000, 0xFF800000,  # Inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA00000, 0xFFC12345,  # NaNs, quiet and signalling
]  # fmt: skip
# odd tails after 8 and 16 lanes; 2**20 + 5: two threads, the float32 output streamed
LENGTHS = (0, 1, 7, 17, 33, 2**20 + 5)


def special_values() -> np.ndarray:
    return np.array(F32_BITS, np.uint32)


def mixed(n: int, seed: int) -> np.ndarray:
    """float32 bits of length n: gradient-like values, random bit patterns and the specials."""
    rng = np.random.default_rng(seed)
    values = (rng.normal(size=n) * 2.0 ** rng.integers(-30, 20, n)).astype(np.float32)
    bits = values.view(np.uint32)
    random_bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    bits = np.where(rng.random(n) < 0.2, random_bits, bits)
    specials = special_values()
    picks = rng.random(n) < 0.1
    return np.where(picks, specials[rng.integers(0, specials.size, n)], bits)


def run(grad: np.ndarray, residual: np.ndarray | None, kind: str, portable: bool):
    g = tf.constant(grad.view(np.float32))
    e = None if residual is None else tf.constant(residual.view(np.float32))

    @tf.function  # on TensorFlow's threads, as in training
    def cast():
        return ops.saturating_cast_feedback(g, e, WIRES[kind], portable=portable)

    wire, new = cast()
    bits = tf.bitcast(wire, tf.uint16).numpy()
    return bits, None if new is None else new.numpy().view(np.uint32)


def both_nan(grad: np.ndarray, residual: np.ndarray | None) -> np.ndarray:
    """Where grad and residual are both NaN: which NaN their sum keeps is the hardware's and
    the compiler's choice (as for TensorFlow's own add), so only NaN-ness is pinned there."""
    if residual is None:
        return np.zeros(grad.shape, bool)
    return np.isnan(grad.view(np.float32)) & np.isnan(residual.view(np.float32))


def assert_nan_where(bits: np.ndarray, where: np.ndarray, kind: str, what: str) -> None:
    values = ref.to_f32(bits, kind) if bits.dtype == np.uint16 else bits.view(np.float32)
    assert np.isnan(values[where]).all(), f"{what}: NaN + NaN gave a number"


def assert_bits_equal(
    got: np.ndarray, want: np.ndarray, what: str, skip: np.ndarray | None = None
) -> None:
    wrong = np.flatnonzero((got != want) & (True if skip is None else ~skip))
    assert wrong.size == 0, (
        f"{what}: {wrong.size} entries differ, first at {wrong[0]}: "
        f"got {got[wrong[0]]:#x}, want {want[wrong[0]]:#x}"
    )


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_kernel_matches_numpy_model_bit_for_bit(kind, portable):
    for n in LENGTHS:
        grad, residual = mixed(n, seed=n), mixed(n, seed=n + 1)
        for e in (residual, None):
            wire, new = run(grad, e, kind, portable)
            want_wire, want_new = ref.saturating_cast_feedback(grad, e, kind)
            skip = both_nan(grad, e)
            assert_bits_equal(wire, want_wire, f"wire n={n} residual={e is not None}", skip)
            assert_nan_where(wire, skip, kind, "wire")
            if e is None:
                assert new is None
            else:
                assert_bits_equal(new, want_new, f"new_residual n={n}", skip)
                assert_nan_where(new, skip, kind, "new_residual")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_specials_alone_on_every_path(kind):
    """Each special value as the sum, in every lane position of a vector and in the tail."""
    specials = special_values()
    grad = np.tile(specials, 3)[: 2 * 16 + 5]
    residual = np.zeros_like(grad)  # +0.0: v = grad (denormals flushed, -0.0 + 0.0 = +0.0)
    want_wire, want_new = ref.saturating_cast_feedback(grad, residual, kind)
    for portable in (False, True):
        wire, new = run(grad, residual, kind, portable)
        assert_bits_equal(wire, want_wire, f"wire portable={portable}")
        assert_bits_equal(new, want_new, f"new_residual portable={portable}")
        wire_alone, _ = run(grad, None, kind, portable)
        assert_bits_equal(wire_alone, ref.saturating_cast_feedback(grad, None, kind)[0], "alone")


def test_numpy_model_pins_rounding_saturation_and_nan():
    """The model itself, on values whose 16-bit results are known by hand."""
    x = np.array(
        [1 + 2.0**-11, 1 + 3 * 2.0**-11, 2.0**-25, 3 * 2.0**-25, 65519.0, 65520.0, -1e30],
        np.float32,
    ).view(np.uint32)
    wire, new = ref.saturating_cast_feedback(x, None, "float16")
    assert new is None
    np.testing.assert_array_equal(
        wire.view(np.float16).astype(np.float64),
        [1.0, 1 + 2.0**-9, 0.0, 2.0**-23, 65504.0, 65504.0, -65504.0],
    )
    nan_bits = np.array([0xFFC00000, 0x7FA00000, 0x7F800000], np.uint32)
    assert [hex(b) for b in ref.saturating_cast_feedback(nan_bits, None, "float16")[0]] == [
        "0xfe00",
        "0x7f00",
        "0x7c00",
    ]
    assert [hex(b) for b in ref.saturating_cast_feedback(nan_bits, None, "bfloat16")[0]] == [
        "0x7fc0",
        "0x7fc0",
        "0x7f80",
    ]
    bf = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.4e38], np.float32).view(np.uint32)
    got = ref.bf16_to_f32(ref.saturating_cast_feedback(bf, None, "bfloat16")[0])
    np.testing.assert_array_equal(got, [1.0, 1 + 2.0**-6, ref.OUTPUT_MAX["bfloat16"]])


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_pure_tf_reference_matches_numpy_model(kind):
    grad, residual = mixed(301, seed=5), mixed(301, seed=6)
    g, e = tf.constant(grad.view(np.float32)), tf.constant(residual.view(np.float32))
    wire, new = tf.function(lambda: pure_tf.saturating_cast_feedback(g, e, WIRES[kind]))()
    want_wire, want_new = ref.saturating_cast_feedback(grad, residual, kind)
    skip = both_nan(grad, residual)
    assert_bits_equal(tf.bitcast(wire, tf.uint16).numpy(), want_wire, "wire", skip)
    assert_bits_equal(new.numpy().view(np.uint32), want_new, "new_residual", skip)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_conservation(kind, portable):
    """grad + residual == float(wire) + new_residual exactly, for normal-range sums."""
    rng = np.random.default_rng(7)
    grad = (rng.normal(size=1001) * 2.0 ** rng.integers(-12, 12, 1001)).astype(np.float32)
    residual = (rng.normal(size=1001) * 1e-3).astype(np.float32)
    wire, new = run(grad.view(np.uint32), residual.view(np.uint32), kind, portable)
    acc = (grad + residual).astype(np.float64)
    sent = ref.to_f32(wire, kind).astype(np.float64)
    np.testing.assert_array_equal(sent + new.view(np.float32).astype(np.float64), acc)


def test_shape_kept_and_bad_input_named():
    g = tf.ones([3, 5])
    wire, new = ops.saturating_cast_feedback(g, tf.zeros([3, 5]), tf.float16)
    assert wire.shape == [3, 5] and wire.dtype == tf.float16 and new.shape == [3, 5]
    with pytest.raises(tf.errors.InvalidArgumentError, match="wire_dtype"):
        ops.saturating_cast_feedback(g, None, tf.float32)
    with pytest.raises(tf.errors.InvalidArgumentError, match="residual must have grad's shape"):
        ops.saturating_cast_feedback(g, tf.zeros([5, 3]), tf.float16)
    with pytest.raises(tf.errors.InvalidArgumentError, match="grad must be float32"):
        ops.saturating_cast_feedback(tf.ones([2], tf.float16), None, tf.bfloat16)


def wire_bits(n: int, kind: str, seed: int) -> np.ndarray:
    """Finite 16-bit patterns of ``kind`` (all but the all-ones exponent)."""
    bits = np.random.default_rng(seed).integers(0, 2**16, n).astype(np.uint16)
    exponent = np.uint16(0x7C00 if kind == "float16" else 0x7F80)
    return np.where((bits & exponent) == exponent, bits & ~np.uint16(0x4000), bits)


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_wire_to_float_matches_numpy_model(kind, portable):
    decode = tf.function(
        lambda w, s: ops.wire_to_float(w, s, portable=portable), reduce_retracing=True
    )
    for n in LENGTHS:
        bits = wire_bits(n, kind, seed=n)
        for scale, bad_at in ((1.0, None), (1 / 3, n // 2), (0.5, n - 1)):
            if bad_at is not None and n:  # one non-finite entry: in the vectors or the tail
                bits = bits.copy()
                bits[bad_at] = 0x7C00 if kind == "float16" else 0xFF80
            wire = tf.bitcast(tf.constant(bits), WIRES[kind])
            out, finite = decode(wire, tf.constant(scale, tf.float32))
            want, want_finite = ref.wire_to_float(bits, scale, kind)
            assert_bits_equal(out.numpy().view(np.uint32), want, f"n={n} scale={scale}")
            assert bool(finite) == want_finite == (bad_at is None or n == 0)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_wire_to_float_pure_tf_matches_numpy_model(kind):
    bits = wire_bits(301, kind, seed=3)
    wire = tf.bitcast(tf.constant(bits), WIRES[kind])
    out, finite = tf.function(lambda: pure_tf.wire_to_float(wire, tf.constant(0.25)))()
    want, want_finite = ref.wire_to_float(bits, 0.25, kind)
    assert_bits_equal(out.numpy().view(np.uint32), want, "pure-TF")
    assert bool(finite) and want_finite


def test_under_xla_equals_kernel():
    """Under XLA the pure-TF reference runs (no custom kernel can): same bits, except the
    payload of NaN + NaN."""
    grad, residual = mixed(203, seed=11), mixed(203, seed=12)
    g, e = tf.constant(grad.view(np.float32)), tf.constant(residual.view(np.float32))

    def round_trips():
        results = []
        for wire_dtype in WIRES.values():
            wire, new = ops.saturating_cast_feedback(g, e, wire_dtype)
            results += [tf.bitcast(wire, tf.uint16), new, *ops.wire_to_float(wire, 0.5)]
        return results

    skip = both_nan(grad, residual)
    got = [t.numpy() for t in tf.function(round_trips, jit_compile=True)()]
    want = [t.numpy() for t in tf.function(round_trips)()]
    for first in (0, 4):  # float16, bfloat16
        assert_bits_equal(got[first], want[first], "wire", skip)
        for i, what in ((first + 1, "new_residual"), (first + 2, "widened")):
            assert_bits_equal(got[i].view(np.uint32), want[i].view(np.uint32), what, skip)
        assert got[first + 3] == want[first + 3]


# -- WireSum: the sum of gathered 16-bit payloads over the ranks ------------------------------
QUIET_NAN = {"float16": 0x7E00, "bfloat16": 0x7FC0}
WIRE_SPECIALS = {  # zeros, denormals, smallest normal, largest finite, Inf, NaNs, 1 and 1 + ulp
    "float16": [0x0000, 0x8000, 0x0001, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00,
                0x7E00, 0xFE01, 0x7C01, 0x3C00, 0x3C01],
    "bfloat16": [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
                 0x7FC0, 0xFFC1, 0x7F81, 0x3F80, 0x3F81],
}  # fmt: skip
EXPONENTS = {"float16": (-26, 17), "bfloat16": (-135, 128)}  # down to denormals, up to overflow


def wire_sum_model(rows: np.ndarray, kind: str) -> np.ndarray:
    """WireSum on ``[P, n]`` bits: the only row as it is; else the rows added in float32 from
    +0.0 in rank order (DAZ/FTZ), rounded once to nearest even (beyond the range: Inf); every
    NaN as QUIET_NAN."""
    if rows.shape[0] == 1:
        out = rows[0]
    else:
        acc = np.zeros(rows.shape[1:], np.uint32)  # +0.0
        for row in rows:
            acc = ref.add(acc, ref.to_f32(row, kind).view(np.uint32), "float32")
        with np.errstate(over="ignore"):
            out = ref.from_f32(acc.view(np.float32), kind)
    return np.where(np.isnan(ref.to_f32(out, kind)), np.uint16(QUIET_NAN[kind]), out)


def gathered_bits(ranks: int, n: int, kind: str, seed: int) -> np.ndarray:
    """``[ranks, n]`` wire bits: gradient-like values over the whole exponent range, random bit
    patterns, the specials, and entries that cancel rank 0's (zero sums of either sign)."""
    rng = np.random.default_rng(seed)
    low, high = EXPONENTS[kind]
    values = rng.normal(size=(ranks, n)) * 2.0 ** rng.integers(low, high, (ranks, n))
    with np.errstate(over="ignore"):
        bits = ref.from_f32(values.astype(np.float32), kind)
    random_bits = rng.integers(0, 2**16, (ranks, n)).astype(np.uint16)
    bits = np.where(rng.random((ranks, n)) < 0.2, random_bits, bits)
    specials = np.array(WIRE_SPECIALS[kind], np.uint16)
    bits = np.where(rng.random((ranks, n)) < 0.1, specials[rng.integers(0, specials.size, n)], bits)
    if ranks > 1:
        bits[1] = np.where(rng.random(n) < 0.1, bits[0] ^ np.uint16(0x8000), bits[1])
    return bits


def run_wire_sum(bits: np.ndarray, kind: str, portable: bool) -> np.ndarray:
    """The kernel's bits, run eagerly (it sets DAZ/FTZ itself, on TensorFlow's threads too)."""
    total = ops.wire_sum(tf.bitcast(tf.constant(bits), WIRES[kind]), portable=portable)
    assert total.dtype == WIRES[kind] and total.shape == bits.shape[1:]
    return tf.bitcast(total, tf.uint16).numpy()


@pytest.mark.parametrize("portable", [False, True], ids=["simd", "portable"])
@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_wire_sum_matches_numpy_model_bit_for_bit(kind, portable):
    """P = 0..3 with tails after 8 and 16 lanes; two threads from 2**16 entries on (P = 2),
    the output streamed from 2**20 on (the SIMD paths)."""
    cases = [(ranks, n) for ranks in (0, 1, 2, 3) for n in (0, 1, 7, 17, 33, 301)]
    for ranks, n in [*cases, (2, 2**16 + 9 if portable else 2**20 + 5)]:
        bits = gathered_bits(ranks, n, kind, seed=7 * ranks + n)
        want = wire_sum_model(bits, kind)
        assert_bits_equal(run_wire_sum(bits, kind, portable), want, f"P={ranks} n={n}")


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_wire_sum_specials_on_every_path(kind):
    """Each pair of specials (and each special alone) in every lane position and the tail."""
    specials = np.array(WIRE_SPECIALS[kind], np.uint16)
    pairs = np.stack(np.meshgrid(specials, specials)).reshape(2, -1)
    for bits in (pairs, pairs[:1], np.concatenate([pairs, pairs[::-1]])[:3]):
        want = wire_sum_model(bits, kind)
        for portable in (False, True):
            assert_bits_equal(run_wire_sum(bits, kind, portable), want, f"P={len(bits)}")


def test_wire_sum_model_pins_rounding_overflow_zeros_and_nan():
    """The model on sums known by hand (and the kernel on them)."""
    bf16 = {  # P rows of one entry -> result
        ((0x7F7F,), (0x7F7F,)): 0x7F80,  # 2 * largest finite: Inf, no saturation
        ((0x8000,), (0x8000,)): 0x0000,  # -0 + -0 from +0.0: +0
        ((0x8000,),): 0x8000,  # one row as it is
        ((0x0001,),): 0x0001,  # a denormal alone is kept ...
        ((0x0001,), (0x0000,)): 0x0000,  # ... and read as zero in a sum
        ((0x3F80,), (0x3B80,), (0x3B80,)): 0x3F81,  # 1 + 2^-8 + 2^-8 rounded once: 1 + 2^-7
        ((0x7F80,), (0xFF80,)): 0x7FC0,  # Inf - Inf
        ((0xFFC1,), (0x3F80,)): 0x7FC0,  # NaN's sign and payload not kept
    }
    half = {
        ((0x7BFF,), (0x4C00,)): 0x7C00,  # 65504 + 16 = 65520 rounds to Inf
        ((0x3C00,), (0x1000,), (0x1000,)): 0x3C01,  # 1 + 2^-11 + 2^-11 rounded once
        ((0x0001,), (0x0001,)): 0x0002,  # float16 subnormals are exact in float32
        ((0xFE01,),): 0x7E00,
    }
    for kind, table in (("bfloat16", bf16), ("float16", half)):
        for rows, want in table.items():
            bits = np.array(rows, np.uint16)
            assert wire_sum_model(bits, kind)[0] == want, (kind, rows)
            for portable in (False, True):
                assert run_wire_sum(bits, kind, portable)[0] == want, (kind, rows, portable)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_wire_sum_equals_the_float32_reduce_sum_it_replaces(kind):
    """Horovod's bfloat16 sum was ``cast(reduce_sum(cast(gathered, float32)), bfloat16)``:
    the same bits, except that TensorFlow's NaN keeps its sign in some lanes."""
    for ranks in (1, 2, 3):
        gathered = tf.bitcast(
            tf.constant(gathered_bits(ranks, 1001, kind, seed=ranks)), WIRES[kind]
        )
        old = tf.cast(tf.reduce_sum(tf.cast(gathered, tf.float32), 0), gathered.dtype)
        new = ops.wire_sum(gathered)
        nan = tf.math.is_nan(old).numpy()
        np.testing.assert_array_equal(tf.math.is_nan(new).numpy(), nan)
        want = tf.bitcast(old, tf.uint16).numpy()
        assert_bits_equal(tf.bitcast(new, tf.uint16).numpy(), want, f"P={ranks}", skip=nan)


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_wire_sum_pure_tf_and_xla_match_numpy_model(kind):
    """The pure-TF reference (P = 1, 2, 3, traced once) and, for bfloat16 (Horovod's case), under
    XLA, where it runs."""
    spec = tf.TensorSpec([None, None], WIRES[kind])
    reference = tf.function(pure_tf.wire_sum, input_signature=[spec])
    for ranks in (1, 2, 3):
        bits = gathered_bits(ranks, 301, kind, seed=ranks + 10)
        got = reference(tf.bitcast(tf.constant(bits), WIRES[kind]))
        want = wire_sum_model(bits, kind)
        assert_bits_equal(tf.bitcast(got, tf.uint16).numpy(), want, f"pure-TF P={ranks}")
    if kind == "float16":
        return
    got = tf.function(ops.wire_sum, jit_compile=True)(tf.bitcast(tf.constant(bits), WIRES[kind]))
    assert_bits_equal(tf.bitcast(got, tf.uint16).numpy(), want, "XLA P=3")


def test_wire_sum_bad_input_named():
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="gathered must be float16 or bfloat16, got float32"
    ):
        ops.wire_sum(tf.ones([2, 3]))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rank >= 1 .*got shape \(\)"):
        ops.wire_sum(tf.constant(1.0, tf.bfloat16))
