"""A bucket's TopK units sent as one packed payload: the packed ops against the NumPy reference
(tensors of different sizes, empty ones, k = 0 and k = n), and the pipeline's packed path
against one message per tensor (same updates, residuals and bytes, one transfer per bucket)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify import ops
from tf_sparsify.collectives import LocalCollective, SimulatedWorkerCollective
from tf_sparsify.compressors import topk_bucket
from tf_sparsify.compressors.rounds import SparseUpdate
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.step import StepFlags, StepMemory
from tf_sparsify.ops import index_code
from tf_sparsify.testing import numpy_reference as ref

SHAPES = [(3, 4), (0,), (7,), (5, 2, 3), (1,), (2, 2)]
KS = [2, 0, 7, 1, 0, 4]  # k = 0, k = n, an empty tensor
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def random(shape, kind: str, rng) -> np.ndarray:
    return rng.standard_normal(shape).astype(NP_DTYPE[kind])


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(ref.BITS[x.dtype.name]).ravel()


def packed_equals_reference(grads, residuals, ks, kind: str):
    """The packed selection of ``grads`` + ``residuals`` equals the NumPy model's selection of
    each tensor alone, bit for bit (new residuals in the grads' shapes); returns ``(values,
    indices, per-tensor model outputs)``."""
    values, indices, new = ops.topk_error_feedback_packed(grads, residuals, ks)
    want = [
        ref.topk_error_feedback(bits(g), bits(r), k, kind)
        for g, r, k in zip(grads, residuals, ks, strict=True)
    ]
    np.testing.assert_array_equal(bits(values.numpy()), np.concatenate([w[0] for w in want]))
    np.testing.assert_array_equal(indices.numpy(), np.concatenate([w[1] for w in want]))
    for r, w, g in zip(new, want, grads, strict=True):
        assert r.shape == g.shape
        np.testing.assert_array_equal(bits(r.numpy()), w[2])
    return values, indices, want


@pytest.fixture(params=[True, False], ids=["compiled", "reference"])
def kernels(request, monkeypatch):
    """The compiled kernels, or the pure-TF reference they fall back to."""
    if not request.param:
        monkeypatch.setattr(ops, "_compiled", lambda: None)
    return request.param


@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_packed_ops_equal_the_numpy_reference(kernels, kind):
    rng = np.random.default_rng(0)
    grads = [random(s, kind, rng) for s in SHAPES]
    residuals = [random(s, kind, rng) for s in SHAPES]
    values, indices, want = packed_equals_reference(grads, residuals, KS, kind)

    sizes = [(int(np.prod(s)), k) for s, k in zip(SHAPES, KS, strict=True)]
    code = ops.encode_indices_packed(indices, sizes)
    codes = [
        ref.index_code_encode(w[1], n, index_code.low_bits_for(n, k))
        for w, (n, k) in zip(want, sizes, strict=True)
    ]
    np.testing.assert_array_equal(code.numpy(), np.concatenate(codes))

    # two replicas: the second sends the first's entries doubled
    gathered = (tf.stack([values, values * 2]), tf.stack([code, code]))
    decoded = ops.decode_indices_packed(gathered[1], sizes)
    np.testing.assert_array_equal(decoded.numpy(), np.stack([indices.numpy()] * 2))
    dense = ops.packed_decompress_sum(*gathered, SHAPES, KS, 0.5)
    half = np.asarray(0.5, NP_DTYPE[kind])
    for d, w, (n, _), part in zip(
        dense, want, sizes, tf.split(gathered[0], KS, axis=1), strict=True
    ):
        summed = ref.scatter_sum(bits(part.numpy()), np.concatenate([w[1]] * 2), n, kind)
        scaled = (summed.view(NP_DTYPE[kind]) * half).astype(NP_DTYPE[kind])
        np.testing.assert_array_equal(bits(d.numpy()), bits(scaled))


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_packed_op_selects_per_tensor_when_the_bucket_shares_the_threads(kind):
    """A tensor big enough to be selected on every thread, then tensors that share the
    threads (each whole on one, largest first, in any order): each selects what it would
    alone, into its own slice of the output."""
    rng = np.random.default_rng(2)
    shapes = [(4099,), (1 << 20,), (300, 7), (5,), (0,), (70001,), (64, 64), (1,), (2, 3)]
    ks = [4099, 10485, 21, 1, 0, 700, 40, 1, 0]
    grads = [random(s, kind, rng) for s in shapes]
    residuals = [random(s, kind, rng) for s in shapes]
    residuals[2][:] = -grads[2]  # all zeros after the add: ties broken by index
    packed_equals_reference(grads, residuals, ks, kind)


def test_packed_ops_name_bad_arguments():
    g = [tf.ones([3]), tf.ones([2])]
    with pytest.raises(tf.errors.InvalidArgumentError, match="k must be in"):
        ops.topk_error_feedback_packed(g, g, [1, 3])
    with pytest.raises(tf.errors.InvalidArgumentError, match="as many residuals and ks"):
        ops.topk_error_feedback_packed(g, g[:1], [1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match="share one dtype"):
        ops.topk_error_feedback_packed(g, [g[0], tf.ones([2], tf.float64)], [1, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"residuals\[1\]"):
        ops.topk_error_feedback_packed(g, [g[0], tf.ones([3])], [1, 1])


def run(packed: bool, monkeypatch, sparse_updates: bool, collective, steps: int = 3):
    """Updates, residuals, bytes and the step's gathers of a few steps of a bucket of TopK
    units (plus a dense Identity unit below min_size), packed or one message per tensor."""
    monkeypatch.setattr(topk_bucket, "packs", lambda c, d: packed and type(c) is tfs.TopK)
    shapes = [(6, 5), (4,), (3, 3, 2), (2,), (40,)]
    pipeline = GradientPipeline(tfs.TopK(ratio=0.2), min_size=3)
    units = pipeline.plan(shapes, [tf.float32] * len(shapes))
    rng = np.random.default_rng(1)
    residuals = [
        tf.zeros(s) if f else None
        for s, f in zip(shapes, pipeline.needs_residual(units, 5), strict=True)
    ]
    out = []
    for step in range(steps):
        grads = [tf.constant(rng.standard_normal(s), tf.float32) for s in shapes]
        result = pipeline.run(
            units,
            grads,
            StepMemory(residuals, tf.constant(step)),
            collective,
            StepFlags(sparse_updates=sparse_updates),
        )
        residuals = [
            r if n is None else n for r, n in zip(residuals, result.residuals, strict=True)
        ]
        out.append((grads, result))
    return units, out


@pytest.mark.parametrize("sparse_updates", [False, True])
@pytest.mark.parametrize(
    "collective", [LocalCollective(), SimulatedWorkerCollective(1, 3)], ids=["local", "worker"]
)
def test_pipeline_packed_path_equals_one_message_per_tensor(
    monkeypatch, sparse_updates, collective
):
    units, packed = run(True, monkeypatch, sparse_updates, collective)
    _, alone = run(False, monkeypatch, sparse_updates, collective)
    assert [len(u.indices) for u in units] == [1] * 5
    for (_, a), (_, b) in zip(packed, alone, strict=True):
        assert a.sent_bytes == b.sent_bytes
        for x, y in zip(a.residuals, b.residuals, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_array_equal(x.numpy(), y.numpy())
        for x, y in zip(a.updates, b.updates, strict=True):
            assert type(x) is type(y)
            if isinstance(x, SparseUpdate):
                for got, want in zip(x.entries(), y.entries(), strict=True):
                    np.testing.assert_array_equal(got.numpy(), want.numpy())
                assert x.scale == y.scale
            else:
                np.testing.assert_array_equal(x.numpy(), y.numpy())


def test_pipeline_packed_path_conserves_and_sends_one_payload(monkeypatch):
    """sum of applied updates + residual == sum of gradients (float64 check), and the bucket's
    four TopK units travel as one PackedUnit."""
    units, steps = run(True, monkeypatch, False, LocalCollective(), steps=4)
    applied = [sum(r.updates[i].numpy().astype(np.float64) for _, r in steps) for i in range(5)]
    fed = [sum(g[i].numpy().astype(np.float64) for g, _ in steps) for i in range(5)]
    last = steps[-1][1]
    for i in range(5):
        kept = 0 if last.residuals[i] is None else last.residuals[i].numpy()
        np.testing.assert_allclose(applied[i] + kept, fed[i], rtol=0, atol=1e-5)

    recorded = []

    class Recording(LocalCollective):
        def all_gather(self, tensors):
            recorded.append(list(tensors))
            return super().all_gather(tensors)

    pipeline = GradientPipeline(tfs.TopK(ratio=0.2), min_size=3)
    shapes = [(6, 5), (4,), (3, 3, 2), (2,), (40,)]
    units = pipeline.plan(shapes, [tf.float32] * 5)
    grads = [tf.ones(s) for s in shapes]
    residuals = [
        tf.zeros(s) if u else None
        for s, u in zip(shapes, pipeline.needs_residual(units, 5), strict=True)
    ]
    pipeline.run(units, grads, StepMemory(residuals, tf.constant(0)), Recording())
    assert [len(call) for call in recorded] == [2]  # one values and one code tensor
