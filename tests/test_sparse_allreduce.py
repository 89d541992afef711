"""SparseAllReduce: on one replica in this process (it is TopK with error feedback there, and
conserves), bad input, tf.distribute refused; on 2 and 3 Horovod ranks (one launch each of
``horovod_workers/sparse.py``): updates, residuals and bytes against the NumPy reference of
the algorithm, the dense fallback, conservation in float64, a non-finite step, ranks
configured differently, and ``model.fit``."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tests import sparse_allreduce_reference as reference
from tests.script_runner import ROOT
from tests.test_horovod import _launch, _passed
from tests.test_optimizer import compile_fit
from tf_sparsify.collectives import LocalCollective
from tf_sparsify.compressors import deserialize, serialize
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.step import StepFlags, StepMemory
from tf_sparsify.distribute import DelayedGradients, ServerOptimizer

SHAPES = [(6, 5), (7,)]


def local_run(compressor, grads: list[np.ndarray], dtype=tf.float32):
    """Per step, ``(updates, residuals)`` of the pipeline on one replica."""
    pipeline = GradientPipeline(compressor)
    units = pipeline.plan(SHAPES, [dtype] * len(SHAPES))
    residuals = [tf.zeros(s, dtype) for s in SHAPES]
    steps = []
    for t in range(grads[0].shape[0]):
        out = pipeline.run(
            units,
            [tf.constant(g[t], dtype) for g in grads],
            StepMemory(residuals, tf.constant(t, tf.int64)),
            LocalCollective(),
        )
        residuals = out.residuals
        steps.append(([u.numpy() for u in out.updates], [r.numpy() for r in residuals]))
    return steps


def make_grads(steps: int, dtype=np.float32, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(steps, *s)).astype(dtype) for s in SHAPES]


@pytest.mark.parametrize("k", [3, 25], ids=["sparse", "dense_fallback"])
def test_one_replica_is_topk_with_error_feedback_and_matches_the_reference(k):
    """On one replica the owner keeps all k entries: the same updates and residuals as TopK,
    whether it sends them sparse or (k = 25 of 30 entries: dense is smaller) dense."""
    grads = make_grads(4)
    got = local_run(tfs.SparseAllReduce(k=k), grads)
    topk = local_run(tfs.TopK(k=k), grads)
    for i, g in enumerate(grads):
        want = reference.run(g.reshape(4, 1, -1), k, 1)
        assert want[0].dense == [k == 25]
        for t, (step, other) in enumerate(zip(got, topk, strict=True)):
            np.testing.assert_array_equal(step[0][i].ravel(), want[t].update)
            np.testing.assert_array_equal(step[1][i].ravel(), want[t].residuals[0])
            np.testing.assert_array_equal(step[0][i], other[0][i])
            np.testing.assert_array_equal(step[1][i], other[1][i])


def test_one_replica_conserves_in_float64():
    """sum of gradients == sum of updates + residual (divisor 1), step by step."""
    grads = make_grads(5, np.float64, seed=1)
    steps = local_run(tfs.SparseAllReduce(ratio=0.2), grads, tf.float64)
    for i, g in enumerate(grads):
        applied = np.cumsum([s[0][i] for s in steps], axis=0)
        for t, step in enumerate(steps):
            np.testing.assert_allclose(g[: t + 1].sum(0), applied[t] + step[1][i], atol=1e-13)


def test_keras_optimizer_trains_on_one_device():
    model, opt = compile_fit(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.SparseAllReduce(0.2)),
        epochs=3,
    )
    assert int(opt.exchange_steps.numpy()) == 12
    assert opt.wire_bytes_per_step < opt.dense_bytes_per_step


def test_wire_bytes_are_the_all_to_all_entries():
    compressor = tfs.SparseAllReduce(k=5)
    assert compressor.wire_bytes(100) == 5 * (4 + 4)
    assert compressor.wire_bytes(100, tf.float16) == 5 * (2 + 4)
    assert compressor.wire_bytes(2**31 + 1, tf.float64) == 5 * (8 + 8)
    assert tfs.SparseAllReduce(ratio=0.1).wire_bytes(95) == 10 * 8
    assert compressor.num_kept(100, 3) == 2


@pytest.mark.parametrize(
    "kwargs, name",
    [({}, "ratio"), ({"ratio": 0.1, "k": 2}, "ratio"), ({"ratio": 0}, "ratio"),
     ({"ratio": 1.5}, "ratio"), ({"k": 0}, "k"), ({"k": 2.0}, "k"), ({"k": True}, "k")],
)  # fmt: skip
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        tfs.SparseAllReduce(**kwargs)


def test_per_replica_updates_and_compress_are_refused():
    pipeline = GradientPipeline(tfs.SparseAllReduce(k=2))
    units = pipeline.plan([(6, 5)], [tf.float32])
    with pytest.raises(ValueError, match="per_replica"):
        pipeline.run(
            units,
            [tf.ones((6, 5))],
            StepMemory([tf.zeros((6, 5))], 0),
            LocalCollective(),
            StepFlags(per_replica=True),
        )
    opt = ServerOptimizer(
        keras.optimizers.SGD(0.1), tfs.SparseAllReduce(k=2), server=DelayedGradients(1)
    )
    with pytest.raises(ValueError, match="per_replica"):
        opt.apply([tf.ones((6, 5))], [keras.Variable(tf.zeros((6, 5)))])
    # a multi-round exchange, not a codec: it has no compress() to call alone
    assert isinstance(tfs.SparseAllReduce(k=2), tfs.compressors.MultiRoundMethod)
    assert not hasattr(tfs.SparseAllReduce(k=2), "compress")


def test_tf_distribute_is_refused_clearly(mirrored2):
    """MirroredStrategy's collectives have no all-to-all: a ValueError at the first step."""
    with pytest.raises(ValueError, match="no all-to-all.*SparseAllReduce runs under Horovod"):
        compile_fit(
            lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.SparseAllReduce(k=2)),
            epochs=1,
            strategy=mirrored2,
        )


def test_config_registry_and_repr():
    compressor = tfs.SparseAllReduce(ratio=0.01)
    assert repr(compressor) == "SparseAllReduce(ratio=0.01, k=None)"
    assert deserialize(serialize(compressor)) == compressor
    assert compressor != tfs.TopK(ratio=0.01)


# -- under horovodrun -----------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3], ids=["2_ranks", "3_ranks"])
def launch(request) -> tuple[dict[str, dict[int, dict]], int]:
    """``({check: {rank: result}}, ranks)`` of one launch of the worker on 2 or 3 ranks."""
    script = os.path.join(ROOT, "tests", "horovod_workers", "sparse.py")
    return _launch(script, ranks=request.param), request.param


def passed(launch: tuple[dict, int], check: str) -> list[dict]:
    found, ranks = launch
    return list(_passed(found, check, ranks).values())


@pytest.mark.processes
def test_updates_residuals_and_bytes_match_the_reference(launch):
    """float32, float16 and bfloat16 tensors in one bucket, slices of unequal length; the
    optimizer in a tf.function and the tape eagerly; bytes to Horovod as the reference's."""
    for record in passed(launch, "exact"):
        assert record["bytes_to_horovod"] > 0


@pytest.mark.processes
def test_dense_fallback_is_decoded_exactly(launch):
    for record in passed(launch, "dense_fallback"):
        assert record["dense_owners"] > 0


@pytest.mark.processes
def test_conservation_in_float64(launch):
    for record in passed(launch, "conservation"):
        assert record["gap"] <= 1e-12


@pytest.mark.processes
def test_a_non_finite_step_is_agreed_and_keeps_the_residuals(launch):
    passed(launch, "non_finite")


@pytest.mark.processes
@pytest.mark.parametrize("check", ["mismatch_k", "mismatch_compressor"])
def test_ranks_configured_differently_fail_fast(launch, check):
    for record in passed(launch, check):
        assert record["seconds"] < 30


@pytest.mark.processes
def test_model_fit_trains_and_keeps_the_ranks_equal(launch):
    passed(launch, "fit")
