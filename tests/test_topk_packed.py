"""TopK's packed payload: the Elias-Fano index code against a NumPy model, 16-bit values with
error feedback (exact per step), exact wire bytes, config, bad input, gathered payloads."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives import LocalCollective, ReplicaContextCollective
from tf_sparsify.compressors import deserialize, serialize
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.step import StepMemory
from tf_sparsify.ops import decode_indices, encode_indices
from tf_sparsify.ops.index_code import index_code_bytes, reference_decode, reference_encode

NP_VALUE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


# -- NumPy model of the code -----------------------------------------------------------------
def model_split(n: int, k: int) -> tuple[int, int]:
    """Low width L (total bits k*L + ((n-1) >> L) + k smallest, ties to the larger L, L <= 32)
    and the length of the high-part bit map."""
    if k == 0:
        return 0, 0
    best = None
    for low in range(min((n - 1).bit_length(), 32) + 1):
        total = k * low + ((n - 1) >> low) + k
        if best is None or total <= best[0]:
            best = (total, low)
    return best[1], ((n - 1) >> best[1]) + k


def model_code(indices: np.ndarray, n: int) -> np.ndarray:
    """Bit (x_j >> L) + j of an H-bit map is 1; bit H + j*L + b holds bit b of index j;
    little-endian bytes."""
    k = len(indices)
    low, high = model_split(n, k)
    bits = np.zeros(high + k * low, np.uint8)
    for j, x in enumerate(int(i) for i in indices):
        bits[(x >> low) + j] = 1
        for b in range(low):
            bits[high + j * low + b] = (x >> b) & 1
    return np.packbits(bits, bitorder="little")


def index_sets() -> list[tuple[int, np.ndarray]]:
    """(n, ascending distinct indices): random, every index, only the last, first and last,
    around powers of two, and sizes past 2**31 and 2**32 (nothing of size n is allocated)."""
    rng = np.random.default_rng(0)
    cases = [(1, [0]), (2, [1]), (2, [0, 1]), (9, [8]), (10, [0, 9]), (5, [])]
    cases += [(n, range(n)) for n in (3, 8, 64, 100)]
    for n in (255, 256, 257, 4095, 4096, 4097, 65536, 1_000_003):
        for k in (1, 3, 17, min(n, 500)):
            picked = rng.choice(n - 1, k - 1, replace=False) if k > 1 else []
            cases.append((n, [*picked, n - 1]))
    cases += [(2**31, [0, 2**31 - 1]), (2**33 + 5, [1, 2**32, 2**33 + 4]), (2**40, [2**40 - 1])]
    return [(n, np.sort(np.asarray(list(idx), np.int64))) for n, idx in cases]


@pytest.mark.parametrize("n, indices", index_sets(), ids=lambda v: str(v)[:20])
def test_code_matches_numpy_model_and_decodes(n, indices):
    """The op (the kernel under TF_SPARSIFY_REQUIRE_OPS=1) and the pure-TF reference give the
    model's bytes and decode them back."""
    dtype = tf.int64 if n > 2**31 - 1 else tf.int32
    for encode, decode in ((encode_indices, decode_indices), (reference_encode, reference_decode)):
        code = encode(tf.constant(indices, dtype), n)
        np.testing.assert_array_equal(code.numpy(), model_code(indices, n))
        assert code.shape == [index_code_bytes(n, len(indices))]
        np.testing.assert_array_equal(decode(code, n, len(indices), dtype).numpy(), indices)


def test_kernel_codes_random_sets_as_the_reference(compiled):
    """Many random sets at TopK's densities, both index dtypes, gathered rows."""
    rng = np.random.default_rng(3)
    for n, k in ((4_194_304, 41_944), (1_605_632, 16_057), (20_480, 205), (1000, 999), (33, 1)):
        sets = np.stack([np.sort(rng.choice(n, k, replace=False)) for _ in range(3)])
        for dtype in (tf.int32, tf.int64):
            codes = tf.stack([encode_indices(tf.constant(s, dtype), n) for s in sets])
            expected = tf.stack([reference_encode(tf.constant(s, dtype), n) for s in sets])
            np.testing.assert_array_equal(codes.numpy(), expected.numpy())
            np.testing.assert_array_equal(decode_indices(codes, n, k, dtype).numpy(), sets)


@pytest.mark.parametrize(
    "indices, message",
    [
        ([3, 2], r"strictly ascending, got indices\[0\] = 3 and indices\[1\] = 2"),
        ([2, 2], r"strictly ascending, got indices\[0\] = 2 and indices\[1\] = 2"),
        ([1, 100], r"indices\[1\] = 100 is out of range \[0, 100\)"),
        ([-1, 5], r"indices\[0\] = -1 is out of range"),
    ],
)
def test_kernel_rejects_indices_that_are_not_a_sorted_set(compiled, indices, message):
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        encode_indices(tf.constant(indices, tf.int32), 100)


def test_kernel_rejects_a_corrupt_code(compiled):
    """A row whose map lacks ones, or that decodes past n, is named instead of giving indices
    that would scatter out of range."""
    code = encode_indices(tf.constant([1, 50, 99], tf.int32), 100).numpy()
    empty = np.zeros_like(code)
    with pytest.raises(tf.errors.InvalidArgumentError, match="code row 1 holds 0 indices"):
        decode_indices(tf.constant(np.stack([code, empty])), 100, 3)
    bits = np.unpackbits(code, bitorder="little")  # n = 100, k = 3: 6 map bits, 5-bit lows
    bits[6 + 2 * 5 : 6 + 3 * 5] = 1  # the last index, 99 = 3 * 32 + 3, becomes 3 * 32 + 31
    with pytest.raises(tf.errors.InvalidArgumentError, match="decodes index 2 to 127"):
        decode_indices(tf.constant(np.packbits(bits, bitorder="little")), 100, 3)


def test_gathered_codes_decode_per_replica():
    """A [P, bytes] stack of different replicas' codes gives each replica's indices."""
    n, rng = 5000, np.random.default_rng(1)
    sets = [np.sort(rng.choice(n, 40, replace=False)) for _ in range(3)]
    sets[2][-1] = n - 1
    codes = tf.stack([encode_indices(tf.constant(s, tf.int32), n) for s in sets])
    np.testing.assert_array_equal(decode_indices(codes, n, 40, tf.int32).numpy(), np.stack(sets))
    # an all-gather under MultiWorkerMirroredStrategy leaves the number of replicas unknown
    spec = tf.TensorSpec([None, codes.shape[1]], tf.uint8)
    decode = tf.function(lambda c: decode_indices(c, n, 40, tf.int32), input_signature=[spec])
    assert decode.get_concrete_function().structured_outputs.shape.as_list() == [None, 40]
    np.testing.assert_array_equal(decode(codes).numpy(), np.stack(sets))


def test_code_size_is_static_and_within_the_elias_fano_bound():
    """<= k (2 + ceil(log2(n/k))) bits while n/k <= 2**32 (low parts are at most 32 bits), also
    past 2**31 entries (Python ints: nothing allocated)."""
    for n in (1, 2, 7, 1000, 2**20, 2**31, 10**10, 2**45):
        for k in {1, 2, max(1, n // 1000), max(1, n // 100), n if n < 10**4 else 1}:
            if n / k > 2**32:
                continue
            bits = k * (2 + math.ceil(math.log2(n / k)))
            assert index_code_bytes(n, k) <= -(-bits // 8), (n, k)
    assert index_code_bytes(0, 0) == 0


@tf.function(input_signature=[tf.TensorSpec([3, 4000], tf.float32)], autograph=False)
def _gathered_indices(x):
    comp = tfs.TopK(ratio=0.01, value_dtype="bfloat16")
    payload, ctx = comp.compress(x[0])
    stacked = tuple(tf.stack([t] * 3) for t in payload)
    return payload, comp.indices(stacked[1], ctx)


def test_payload_shapes_are_static_in_a_graph():
    payload, indices = _gathered_indices.get_concrete_function().structured_outputs
    assert payload[0].shape == [40] and payload[0].dtype == tf.bfloat16
    assert payload[1].shape == [index_code_bytes(4000, 40)] and payload[1].dtype == tf.uint8
    assert indices.shape == [3, 40]


# -- payload and decompression -----------------------------------------------------------------
def numpy_topk(x: np.ndarray, k: int) -> np.ndarray:
    order = sorted(range(x.size), key=lambda i: (-abs(float(x.flat[i])), i))
    return np.sort(np.array(order[:k], dtype=np.int64))


@pytest.mark.parametrize("value_dtype", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("n, k", [(1, 1), (2, 2), (257, 257), (1000, 37), (4096, 5)])
def test_payload_and_decompress_match_numpy(value_dtype, n, k):
    rng = np.random.default_rng(n + k)
    x = np.round(rng.normal(size=n), 2).astype(np.float32)  # ties
    x[-1] = 100.0  # the last index is always sent
    comp = tfs.TopK(k=k, value_dtype=value_dtype)
    (values, code), ctx = comp.compress(tf.constant(x))
    idx = numpy_topk(x, k)
    sent = x[idx] if value_dtype is None else x[idx].astype(NP_VALUE[value_dtype])
    np.testing.assert_array_equal(comp.indices(code, ctx).numpy(), idx)
    np.testing.assert_array_equal(code.numpy(), model_code(idx, n))
    np.testing.assert_array_equal(values.numpy(), sent)
    dense = np.zeros_like(x)
    dense[idx] = sent.astype(np.float32)
    np.testing.assert_array_equal(comp.decompress((values, code), ctx).numpy(), dense)
    mask = np.zeros_like(x)
    mask[idx] = 1  # also where a sent value is 0
    np.testing.assert_array_equal(comp.sent_mask((values, code), ctx).numpy(), mask)


def test_decompress_sum_of_gathered_payloads_equals_sum_of_decompressed():
    """Three replicas with overlapping supports: one scatter of the [P, ...] payload."""
    comp = tfs.TopK(ratio=0.05, value_dtype="float16")
    xs = tf.random.stateless_normal([3, 20, 30], seed=[5, 6])
    xs = tf.concat([xs[:1], xs[:1] * 2, xs[2:]], 0)  # replicas 0 and 1 send the same indices
    payloads = [comp.compress(x)[0] for x in xs]
    ctx = comp.compress(xs[0])[1]
    gathered = tuple(tf.stack(parts) for parts in zip(*payloads, strict=True))
    expected = sum(comp.decompress(p, ctx) for p in payloads)
    np.testing.assert_array_equal(comp.decompress_sum(gathered, ctx, 3).numpy(), expected.numpy())


def test_two_replicas_gather_packed_payloads(mirrored2):
    """Under MirroredStrategy the update is the sum of each replica's decompressed payload and
    each residual is its own compress_with_feedback remainder."""
    comp = tfs.TopK(ratio=0.1, value_dtype="bfloat16")
    pipeline = GradientPipeline(comp, error_feedback=True)
    units = pipeline.plan([(9, 7)], [tf.float32])
    grads = tf.random.stateless_normal([2, 9, 7], seed=[1, 2])
    resid = tf.random.stateless_normal([2, 9, 7], seed=[3, 4])

    @tf.function(autograph=False)
    def run():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            r = ctx.replica_id_in_sync_group
            collective = ReplicaContextCollective(ctx)
            out = pipeline.run(
                units, [grads[r]], StepMemory([resid[r]], tf.constant(3, tf.int64)), collective
            )
            return out.updates[0], out.residuals[0]

        return mirrored2.run(replica_fn)

    updates, residuals = (mirrored2.experimental_local_results(t) for t in run())
    expected = 0
    for r in range(2):
        payload, ctx, remainder = comp.compress_with_feedback(grads[r], resid[r], 3, 0, r)
        expected += comp.decompress(payload, ctx)
        np.testing.assert_array_equal(residuals[r].numpy(), remainder.numpy())
    for u in updates:
        np.testing.assert_array_equal(u.numpy(), expected.numpy())


# -- error feedback with 16-bit values ---------------------------------------------------------
SHAPES = [(30, 7), (9,), (1,)]


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_feedback_keeps_the_rounding_error_exactly(value_dtype, dtype):
    """Every step through the pipeline: update + new residual == gradient + old residual bit for
    bit, the residual at a sent index is acc - float(sent value); over the steps, applied +
    residual == the sum of gradients up to the rounding of those running sums."""
    pipeline = GradientPipeline(tfs.TopK(ratio=0.1, value_dtype=value_dtype))
    units = pipeline.plan(SHAPES, [dtype] * len(SHAPES))
    rng = np.random.default_rng(3)
    residuals = [tf.zeros(s, dtype) for s in SHAPES]
    applied = [np.zeros(s) for s in SHAPES]
    total = [np.zeros(s) for s in SHAPES]
    steps, largest = 8, 0.0
    for step in range(steps):
        scale = 10.0 ** rng.integers(-3, 4)
        grads = [tf.constant(rng.normal(size=s) * scale, dtype) for s in SHAPES]
        out = pipeline.run(units, grads, StepMemory(residuals, step), LocalCollective())
        for i in range(len(SHAPES)):
            acc = (grads[i] + residuals[i]).numpy()
            largest = max(largest, float(np.abs(acc).max()))
            np.testing.assert_array_equal((out.updates[i] + out.residuals[i]).numpy(), acc)
            sent = out.updates[i].numpy() != 0
            rounded = acc[sent].astype(NP_VALUE[value_dtype]).astype(acc.dtype)
            np.testing.assert_array_equal(out.updates[i].numpy()[sent], rounded)
            applied[i] += out.updates[i].numpy()
            total[i] += grads[i].numpy()
        residuals = list(out.residuals)
    assert any(np.any(r.numpy() != 0) for r in residuals)
    tol = steps * np.finfo(dtype.as_numpy_dtype).eps * largest  # acc = g + e rounds each step
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(applied[i] + residuals[i].numpy(), total[i], rtol=0, atol=tol)


@pytest.mark.parametrize(
    "value_dtype, dtype, big, wire_max",
    [
        ("float16", tf.float32, 1e6, 65504.0),
        ("bfloat16", tf.float64, 1e300, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)),
    ],
)
def test_values_beyond_the_16_bit_range_saturate_and_the_excess_stays(
    value_dtype, dtype, big, wire_max
):
    comp = tfs.TopK(k=3, value_dtype=value_dtype)
    g = tf.constant([big, 0.5, -big, 1.0, 2.0], dtype)
    (values, code), ctx, residual = comp.compress_with_feedback(g, tf.zeros_like(g))
    np.testing.assert_array_equal(values.numpy().astype(np.float64), [wire_max, -wire_max, 2.0])
    np.testing.assert_array_equal(residual.numpy(), [big - wire_max, 0.5, wire_max - big, 1.0, 0.0])


@pytest.mark.parametrize("value_dtype", ["float16", "bfloat16"])
def test_non_finite_values_pass_and_the_step_is_marked(value_dtype):
    """NaN and Inf travel as they are (reveals_non_finite), the residual there stays 0, and the
    pipeline marks the step non-finite."""
    comp = tfs.TopK(k=2, value_dtype=value_dtype)
    assert comp.reveals_non_finite
    g = tf.constant([1.0, float("nan"), 3.0, -float("inf")])
    (values, _), _, residual = comp.compress_with_feedback(g, tf.zeros_like(g))
    assert np.isnan(values.numpy()[0]) and values.numpy()[1] == -np.inf
    np.testing.assert_array_equal(residual.numpy(), [1.0, 0.0, 3.0, 0.0])
    pipeline = GradientPipeline(comp)
    units = pipeline.plan([(4,)], [tf.float32])
    out = pipeline.run(units, [g], StepMemory([tf.zeros([4])], 0), LocalCollective())
    assert not bool(out.finite)


# -- wire bytes, dtypes, config, bad input -----------------------------------------------------
@pytest.mark.parametrize("value_dtype", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64])
def test_wire_bytes_equal_the_payload_bytes(value_dtype, dtype):
    for n in (1, 2, 3, 8, 9, 255, 256, 257, 1024, 1025, 3001):
        for comp in (
            tfs.TopK(k=1, value_dtype=value_dtype),
            tfs.TopK(0.3, value_dtype=value_dtype),
        ):
            payload, _ = comp.compress(tf.cast(tf.range(n) % 7, dtype))
            sent = sum(int(np.prod(t.shape)) * t.dtype.size for t in payload)
            assert comp.wire_bytes(n, dtype) == sent, (n, comp)


def test_wire_bytes_past_2_31_entries_without_allocating():
    n = 2**31
    assert tfs.TopK(k=1).wire_bytes(n) == 4 + 4  # 31 low bits and a 1-bit map
    k = math.ceil(0.001 * n)
    low, high = model_split(n, k)
    expected = k * 2 + -(-(k * low + high) // 8)
    assert tfs.TopK(ratio=0.001, value_dtype="bfloat16").wire_bytes(n) == expected
    assert tfs.TopK(k=3).wire_bytes(10**12, tf.float64) == 3 * 8 + index_code_bytes(10**12, 3)


def test_values_travel_in_the_narrower_of_the_two_dtypes():
    comp = tfs.TopK(k=2, value_dtype="bfloat16")
    assert comp.wire_dtype(tf.float32) == tf.bfloat16
    assert comp.wire_dtype(tf.float16) == tf.float16  # as wide: sent as it is
    assert tfs.TopK(k=2, value_dtype="float16").wire_dtype(tf.bfloat16) == tf.bfloat16
    assert tfs.TopK(k=2).wire_dtype(tf.float64) == tf.float64
    x = tf.constant([1.0, -3.0, 2.0], tf.float16)
    (values, _), _, residual = comp.compress_with_feedback(x, tf.zeros_like(x))
    assert values.dtype == tf.float16 and not np.any(residual.numpy()[[1, 2]])


def test_config_round_trip_with_value_dtype():
    comp = tfs.TopK(ratio=0.01, value_dtype=tf.bfloat16)
    assert comp.get_config() == {"ratio": 0.01, "k": None, "value_dtype": "bfloat16"}
    again = deserialize(json.loads(json.dumps(serialize(comp))))
    assert again == comp and hash(again) == hash(comp) and again.value_dtype == "bfloat16"
    assert tfs.TopK(k=3, value_dtype="float16") != tfs.TopK(k=3)
    assert deserialize({"class_name": "TopK", "config": {"ratio": 0.1, "k": None}}) == tfs.TopK(0.1)


@pytest.mark.parametrize("bad", ["float32", "fp16", "int8", tf.float64, np.float16, 16, True])
def test_bad_value_dtype_is_named(bad):
    with pytest.raises(ValueError, match=r"`value_dtype` must be None.*value_dtype="):
        tfs.TopK(k=1, value_dtype=bad)


def test_bad_code_is_named():
    comp = tfs.TopK(k=4)
    (values, code), ctx = comp.compress(tf.range(100.0))
    for bad in (code[:-1], tf.cast(code, tf.int32), code[0]):
        with pytest.raises(
            tf.errors.InvalidArgumentError, match=r"code must be uint8 with 4 bytes"
        ):
            comp.decompress((values, bad), ctx)
