"""The Elias-Fano index code: a row that is not the code of a strictly ascending index set fails
on every decoder (kernel, pure-TF reference, NumPy model), naming the row and why (all-0xFF bytes
for n = 8, k = 8 once decoded to eight zeros); valid codes decode exactly everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.ops import decode_indices, encode_indices
from tf_sparsify.ops.index_code import (
    index_code_bytes,
    low_bits_for,
    reference_decode,
    reference_encode,
)
from tf_sparsify.testing import numpy_reference

SHAPES = [(8, 8), (1, 1), (2, 1), (2, 2), (9, 3), (100, 3), (100, 7), (64, 64), (1000, 10)]
SHAPES += [(4097, 40), (100_003, 17), (2**31, 2)]


def candidate_rows(count: int = 160) -> list[tuple[int, int, np.ndarray]]:
    """``count`` rows of the code's size for various (n, k): all-zero and all-0xFF rows of
    every shape, the rest random bytes."""
    rng = np.random.default_rng(20240601)
    rows = []
    for n, k in SHAPES:
        size = index_code_bytes(n, k)
        rows += [(n, k, np.zeros(size, np.uint8)), (n, k, np.full(size, 255, np.uint8))]
    while len(rows) < count:
        n, k = SHAPES[rng.integers(len(SHAPES))]
        rows.append((n, k, rng.integers(0, 256, index_code_bytes(n, k), dtype=np.uint8)))
    return rows


def single_bit_flips() -> list[tuple[int, int, np.ndarray]]:
    """Valid codes with one bit flipped: moved, added or dropped map ones, changed low parts,
    set padding bits."""
    rng = np.random.default_rng(7)
    rows = []
    for n, k in SHAPES[:-1]:
        code = model_encode(np.sort(rng.choice(n, k, replace=False)), n)
        for bit in range(8 * code.size):
            flipped = code.copy()
            flipped[bit // 8] ^= np.uint8(1 << (bit % 8))
            rows.append((n, k, flipped))
    return rows


def model_encode(indices: np.ndarray, n: int) -> np.ndarray:
    """The reference encoder (pure TF), checked against the NumPy model's bytes."""
    code = reference_encode(tf.constant(indices, tf.int64), n).numpy()
    low = low_bits_for(n, len(indices))
    np.testing.assert_array_equal(code, numpy_reference.index_code_encode(indices, n, low))
    return code


def is_code_of_ascending_set(row: np.ndarray, n: int, k: int) -> bool:
    """Oracle, independent of the decoders' checks: read the first k ones of the map and the
    low parts; the row is valid iff those indices ascend strictly below n and encode back to
    the row."""
    low = low_bits_for(n, k)
    high = ((n - 1) >> low) + k
    bits = np.unpackbits(row, bitorder="little").astype(np.int64)
    ones = np.flatnonzero(bits[:high])[:k]
    if ones.size < k:
        return False
    lows = bits[high : high + k * low].reshape(k, low) @ (np.int64(1) << np.arange(low))
    indices = ((ones - np.arange(k)) << low) | lows
    if np.any(indices >= n) or np.any(np.diff(indices) <= 0):
        return False
    return bool(np.array_equal(model_encode(indices, n), row))


def _check_rejected(n: int, k: int, row: np.ndarray, decoders) -> None:
    """Each decoder fails on a stack whose row 2 is ``row`` (rows 0 and 1 valid), naming row
    2."""
    rng = np.random.default_rng(n + k)
    good = [model_encode(np.sort(rng.choice(n, k, replace=False)), n) for _ in range(2)]
    stack = np.stack([*good, row])
    dtype = tf.int64 if n > 2**31 - 1 else tf.int32
    for name, decode in decoders:
        if name == "numpy":
            with pytest.raises(ValueError, match=r"code row 2 "):
                numpy_reference.index_code_decode(stack, n, k, low_bits_for(n, k))
        else:
            with pytest.raises(tf.errors.InvalidArgumentError, match=r"code row 2 "):
                decode(tf.constant(stack), n, k, dtype).numpy()


def _decoders(compiled_available: bool):
    decoders = [("pure-TF", reference_decode), ("numpy", None)]
    if compiled_available:
        decoders.append(("kernel", decode_indices))
    return decoders


def test_random_zero_and_ff_rows_fail_unless_they_are_a_code(compiled):
    rows = candidate_rows()
    assert len(rows) == 160
    rejected = 0
    for n, k, row in rows:
        if is_code_of_ascending_set(row, n, k):  # a random row can be a code by chance
            low = low_bits_for(n, k)
            expected = numpy_reference.index_code_decode(row, n, k, low)
            np.testing.assert_array_equal(
                decode_indices(tf.constant(row), n, k, tf.int64), expected
            )
            continue
        rejected += 1
        _check_rejected(n, k, row, _decoders(True))
    assert rejected == len(rows)  # none of these seeded rows is a code by chance


def test_all_ff_bytes_for_eight_of_eight_fail_instead_of_eight_zeros(compiled):
    row = np.full(index_code_bytes(8, 8), 255, np.uint8)
    with pytest.raises(tf.errors.InvalidArgumentError, match="code row 0"):
        decode_indices(tf.constant(row), 8, 8).numpy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="code row"):
        reference_decode(tf.constant(row), 8, 8, tf.int32).numpy()
    with pytest.raises(ValueError, match="code row 0"):
        numpy_reference.index_code_decode(row, 8, 8, low_bits_for(8, 8))


def test_single_bit_flips_of_valid_codes_fail_unless_they_are_a_code(compiled):
    """A flipped map or padding bit always breaks the code (the map's ones count, or a set
    padding bit); a flipped low-part bit can give the code of another ascending set, which must
    decode to it."""
    flips = single_bit_flips()
    sample = []
    for n, k, row in flips:
        low = low_bits_for(n, k)
        if is_code_of_ascending_set(row, n, k):
            expected = numpy_reference.index_code_decode(row, n, k, low)
            np.testing.assert_array_equal(
                decode_indices(tf.constant(row), n, k, tf.int64), expected
            )
            continue
        with pytest.raises(tf.errors.InvalidArgumentError, match="code row 0 "):
            decode_indices(tf.constant(row), n, k, tf.int64).numpy()
        with pytest.raises(ValueError, match="code row 0 "):
            numpy_reference.index_code_decode(row, n, k, low)
        sample.append((n, k, row))
    assert len(sample) >= 400  # 430 of the 928 flips (seeded) are not a code
    for n, k, row in sample[::7]:  # the pure-TF reference: a sample (each call runs many ops)
        with pytest.raises(tf.errors.InvalidArgumentError, match="code row 0 "):
            reference_decode(tf.constant(row), n, k, tf.int64).numpy()


def _code_100_3(ones: list[int], lows: list[int]) -> np.ndarray:
    """A row for n = 100, k = 3 (L = 5: a 6-bit map, then three 5-bit low parts) with map
    ones at ``ones`` and low parts ``lows``."""
    bits = np.zeros(8 * index_code_bytes(100, 3), np.uint8)
    bits[np.asarray(ones, np.int64)] = 1
    for j, x in enumerate(lows):
        bits[6 + 5 * j : 6 + 5 * (j + 1)] = [(x >> b) & 1 for b in range(5)]
    return np.packbits(bits, bitorder="little")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        # highs 0, 0, 0 with low parts 7, 7, 9: index 1 repeats index 0
        (_code_100_3([0, 1, 2], [7, 7, 9]), "decodes index 0 to 7 and index 1 to 7, not strictly"),
        # highs 0, 0 with low parts 9, 3: index 1 below index 0
        (_code_100_3([0, 1, 5], [9, 3, 3]), "decodes index 0 to 9 and index 1 to 3, not strictly"),
        # the code of [1, 50, 99] (map ones 0, 2, 5) with a fourth one at bit 4
        (_code_100_3([0, 2, 4, 5], [1, 18, 3]), r"more than k = 3 ones \(a stray one at bit 5\)"),
        (_code_100_3([], []), "holds 0 indices, expected k = 3"),
        (_code_100_3([0, 2], [1, 18, 3]), "holds 2 indices, expected k = 3"),
        (_code_100_3([0, 2, 5], [1, 18, 31]), r"decodes index 2 to 127, out of range \[0, 100\)"),
    ],
)
def test_kernel_names_why_a_row_is_not_a_code(compiled, row, message):
    assert not is_code_of_ascending_set(row, 100, 3)
    with pytest.raises(tf.errors.InvalidArgumentError, match=f"code row 0 .*{message}"):
        decode_indices(tf.constant(row), 100, 3).numpy()
    with pytest.raises(ValueError, match="code row 0"):
        numpy_reference.index_code_decode(row, 100, 3, low_bits_for(100, 3))
    np.testing.assert_array_equal(  # the same ones and lows as a valid code: it decodes
        decode_indices(tf.constant(_code_100_3([0, 2, 5], [1, 18, 3])), 100, 3), [1, 50, 99]
    )


def test_padding_bits_must_be_zero(compiled):
    n, k = 100, 3  # 6 map bits + 3 * 5 low bits = 21 bits in 3 bytes: bits 21..23 are padding
    code = model_encode(np.array([1, 50, 99]), n)
    code[-1] |= 0x80
    with pytest.raises(tf.errors.InvalidArgumentError, match="padding bits after bit 21"):
        decode_indices(tf.constant(code), n, k).numpy()
    with pytest.raises(ValueError, match="padding bits"):
        numpy_reference.index_code_decode(code, n, k, low_bits_for(n, k))
    with pytest.raises(tf.errors.InvalidArgumentError, match="code row"):
        reference_decode(tf.constant(code), n, k, tf.int32).numpy()


def test_topk_decompress_fails_on_a_corrupt_code(compiled):
    """The case adversarial testing found: TopK summed eight zeros for an all-0xFF code."""
    compressor = tfs.TopK(k=8)
    payload, ctx = compressor.compress(tf.range(1.0, 9.0))
    corrupt = (payload[0], tf.fill(payload[1].shape, tf.constant(255, tf.uint8)))
    with pytest.raises(tf.errors.InvalidArgumentError, match="code row 0"):
        compressor.decompress(corrupt, ctx).numpy()


def test_valid_codes_decode_exactly_on_every_decoder(compiled):
    rng = np.random.default_rng(11)
    for n, k in SHAPES + [(5, 0), (1_000_003, 500), (2**33 + 5, 3)]:
        dtype = tf.int64 if n > 2**31 - 1 else tf.int32
        sets = np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(4)])
        codes = np.stack([model_encode(s, n) for s in sets])
        low = low_bits_for(n, k)
        for s, code in zip(sets, codes, strict=True):
            assert is_code_of_ascending_set(code, n, k) or k == 0
            np.testing.assert_array_equal(encode_indices(tf.constant(s, dtype), n).numpy(), code)
        np.testing.assert_array_equal(decode_indices(tf.constant(codes), n, k, dtype), sets)
        np.testing.assert_array_equal(reference_decode(tf.constant(codes), n, k, dtype), sets)
        np.testing.assert_array_equal(numpy_reference.index_code_decode(codes, n, k, low), sets)


def test_the_pure_tf_check_runs_inside_a_function_and_not_under_xla():
    n, k = 100, 3
    good = model_encode(np.array([1, 50, 99]), n)
    bad = np.full_like(good, 255)
    decode = tf.function(lambda c: reference_decode(c, n, k, tf.int32))
    np.testing.assert_array_equal(decode(tf.constant(good)), [1, 50, 99])
    with pytest.raises(tf.errors.InvalidArgumentError, match="code row"):
        decode(tf.constant(np.stack([good, bad])))
    jitted = tf.function(lambda c: reference_decode(c, n, k, tf.int32), jit_compile=True)
    np.testing.assert_array_equal(jitted(tf.constant(good)), [1, 50, 99])


def test_an_empty_stack_of_codes_decodes_to_no_rows(compiled):
    empty = np.zeros((0, index_code_bytes(100, 3)), np.uint8)
    assert decode_indices(tf.constant(empty), 100, 3).shape == [0, 3]
    assert reference_decode(tf.constant(empty), 100, 3, tf.int32).shape == [0, 3]
    assert numpy_reference.index_code_decode(empty, 100, 3, low_bits_for(100, 3)).shape == (0, 3)
