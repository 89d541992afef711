"""Pipeline contracts: conservation, averaging across replicas, scopes, non-finite policy."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives import LocalCollective, ReplicaContextCollective
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import bytes_per_step
from tf_sparsify.core.step import StepMemory

SHAPES = [(12, 5), (5,), (3, 4, 2)]


def run_steps(pipeline, grads_per_step, dtype=tf.float64):
    """Drive the pipeline like a front end does on one device; return (applied, residuals)."""
    units = pipeline.plan(SHAPES, [dtype] * len(SHAPES))
    residuals = [tf.zeros(s, dtype) for s in SHAPES]
    applied = [tf.zeros(s, dtype) for s in SHAPES]
    for t, grads in enumerate(grads_per_step):
        out = pipeline.run(
            units, grads, StepMemory(residuals, tf.constant(t, tf.int64)), LocalCollective()
        )
        applied = [a + u for a, u in zip(applied, out.updates, strict=True)]
        residuals = [r if n is None else n for r, n in zip(residuals, out.residuals, strict=True)]
    return applied, residuals


def random_grads(steps, dtype=tf.float64, seed=0):
    rng = np.random.default_rng(seed)
    return [[tf.constant(rng.normal(size=s), dtype) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize(
    "compressor, scope",
    [
        (tfs.TopK(ratio=0.1), "layer"),
        (tfs.TopK(k=2), "global"),
        (tfs.ScaledSign(), "layer"),
        # URQs with beta < 1: error feedback needs a contraction
        (tfs.QSGD(levels=8), "layer"),
        (tfs.RandomK(ratio=0.6), "global"),
    ],
    ids=repr,
)
def test_conservation_float64(compressor, scope):
    """Sum of applied updates + residuals equals the sum of all gradients."""
    grads = random_grads(15)
    pipeline = GradientPipeline(compressor, error_feedback=True, scope=scope)
    applied, residuals = run_steps(pipeline, grads)
    for i in range(len(SHAPES)):
        total = sum(step[i] for step in grads)
        np.testing.assert_allclose((applied[i] + residuals[i]).numpy(), total.numpy(), atol=1e-12)
    assert any(float(tf.reduce_max(tf.abs(r))) > 0 for r in residuals)


def test_topk_with_feedback_follows_the_paper_recursion():
    """acc = e + g; s = TopK(acc); e = acc - s, checked against numpy."""
    grads = random_grads(6)
    applied, residuals = run_steps(GradientPipeline(tfs.TopK(k=3)), grads)
    e = [np.zeros(s) for s in SHAPES]
    sent = [np.zeros(s) for s in SHAPES]
    for step in grads:
        for i, g in enumerate(step):
            acc = (e[i] + g.numpy()).ravel()
            keep = np.sort(np.argsort(-np.abs(acc), kind="stable")[: min(3, acc.size)])
            s = np.zeros_like(acc)
            s[keep] = acc[keep]
            sent[i] += s.reshape(SHAPES[i])
            e[i] = (acc - s).reshape(SHAPES[i])
    for i in range(len(SHAPES)):
        np.testing.assert_allclose(applied[i].numpy(), sent[i], atol=1e-12)
        np.testing.assert_allclose(residuals[i].numpy(), e[i], atol=1e-12)


def test_global_scope_selects_over_all_tensors():
    grads = [tf.constant([[0.1, 5.0], [0.2, 0.3]], tf.float64), tf.constant([4.0, 0.5], tf.float64)]
    pipeline = GradientPipeline(tfs.TopK(k=2), scope="global")
    units = pipeline.plan([(2, 2), (2,)], [tf.float64] * 2)
    assert len(units) == 1
    out = pipeline.run(
        units, grads, StepMemory([tf.zeros_like(g) for g in grads], 0), LocalCollective()
    )
    np.testing.assert_array_equal(out.updates[0].numpy(), [[0, 5.0], [0, 0]])
    np.testing.assert_array_equal(out.updates[1].numpy(), [4.0, 0])


def test_min_size_tensors_travel_dense_without_memory():
    pipeline = GradientPipeline(tfs.TopK(k=1), min_size=10)
    units = pipeline.plan(SHAPES, [tf.float32] * 3)
    assert [u.compressor for u in units] == [tfs.TopK(k=1), tfs.Identity(), tfs.TopK(k=1)]
    assert pipeline.needs_residual(units, 3) == [True, False, True]
    wire, dense = bytes_per_step(units)
    assert dense == 4 * (60 + 5 + 24) and wire == 5 + 4 * 5 + 5  # TopK: a value, a 1-byte code


def test_none_gradients_are_skipped():
    pipeline = GradientPipeline(tfs.TopK(k=1))
    units = pipeline.plan(SHAPES, [tf.float32] * 3)
    grads = [tf.ones(SHAPES[0]), None, tf.ones(SHAPES[2])]
    out = pipeline.run(
        units, grads, StepMemory([tf.zeros(s) for s in SHAPES], 0), LocalCollective()
    )
    assert out.updates[1] is None and out.residuals[1] is None and out.updates[0] is not None


@pytest.mark.parametrize(
    "compressor", [tfs.TopK(k=2), tfs.RandomK(ratio=0.6), tfs.QSGD(8)], ids=repr
)
def test_non_finite_gradient_marks_the_step(compressor):
    grads = [tf.ones(s) for s in SHAPES]
    grads[0] = tf.tensor_scatter_nd_update(grads[0], [[11, 4]], [float("nan")])
    pipeline = GradientPipeline(compressor, error_feedback=True)
    units = pipeline.plan(SHAPES, [tf.float32] * 3)
    out = pipeline.run(
        units, grads, StepMemory([tf.zeros(s) for s in SHAPES], 0), LocalCollective()
    )
    assert not bool(out.finite)
    assert not bool(tf.reduce_all(tf.math.is_finite(out.updates[0])))
    clean = pipeline.run(
        units,
        [tf.ones(s) for s in SHAPES],
        StepMemory([tf.zeros(s) for s in SHAPES], 0),
        LocalCollective(),
    )
    assert bool(clean.finite)


def test_indexed_slices_gradients_are_compressed_over_their_rows():
    """More in tests/test_sparse_gradients.py."""
    pipeline = GradientPipeline(tfs.TopK(k=2))
    units = pipeline.plan([(4, 3)], [tf.float32])
    g = tf.IndexedSlices(
        tf.constant([[1.0, 2, 3], [4, 5, 6]]), tf.constant([1, 3]), tf.constant([4, 3])
    )
    out = pipeline.run(units, [g], StepMemory([tf.zeros((4, 3))], 0), LocalCollective())
    assert isinstance(out.updates[0], tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(out.updates[0]).numpy()[3], [0, 5, 6])


@pytest.mark.parametrize(
    "compressor",
    # contracting at 30 entries, as error feedback needs
    [tfs.TopK(ratio=0.2), tfs.QSGD(levels=8), tfs.ScaledSign(), tfs.RandomK(0.6), tfs.BF16()],
    ids=repr,
)
def test_replica_average_equals_sum_of_decompressed_payloads(mirrored2, compressor):
    """Across 2 replicas the update is sum_p decompress(compress(g_p + e_p)) (Keras prescales).

    Summable payloads are added on the wire (16-bit casts in their 16-bit type, as Horovod's
    fp16 compression does), then decompressed once.
    """
    pipeline = GradientPipeline(compressor, error_feedback=True)
    units = pipeline.plan([(6, 5)], [tf.float32])
    base = tf.random.stateless_normal([2, 6, 5], seed=[1, 2])
    resid = tf.random.stateless_normal([2, 6, 5], seed=[3, 4])

    @tf.function
    def run():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            r = ctx.replica_id_in_sync_group
            out = pipeline.run(
                units,
                [base[r]],
                StepMemory([resid[r]], tf.constant(7, tf.int64)),
                ReplicaContextCollective(ctx),
            )
            return out.updates[0], out.residuals[0]

        return mirrored2.run(replica_fn)

    updates, residuals = run()
    updates = mirrored2.experimental_local_results(updates)
    residuals = mirrored2.experimental_local_results(residuals)
    expected, wire_sum = 0, None
    for r in range(2):
        payload, ctx, remainder = compressor.compress_with_feedback(base[r], resid[r], 7, 0, r)
        expected += compressor.decompress(payload, ctx)
        wire_sum = (
            payload if wire_sum is None else [a + b for a, b in zip(wire_sum, payload, strict=True)]
        )
        np.testing.assert_allclose(residuals[r].numpy(), remainder.numpy(), atol=1e-6)
    if compressor.summable:
        expected = compressor.decompress(tuple(wire_sum), ctx)
    for u in updates:
        np.testing.assert_allclose(u.numpy(), expected.numpy(), atol=1e-5)
