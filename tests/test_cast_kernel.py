"""The fused 16-bit cast with error feedback (SaturatingCastFeedback): bit for bit against the
NumPy model on both kernel paths (F16C / AVX512-BF16 where the CPU has them, and the portable
path forced, so both are pinned on every machine) and on the pure-TF reference."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.ops import numpy_reference as ref
from tf_sparsify.ops import pure_tf

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
