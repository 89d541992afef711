"""Buckets: planning in backprop order, one exchange per bucket that depends only on the
bucket's own gradients (so late layers' collectives can overlap earlier backprop), and the
per-bucket non-finite agreement across replicas."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives import LocalCollective
from tf_sparsify.core.options import DEFAULT_BUCKET_BYTES
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.step import StepMemory

# float32 sizes in bytes: 400, 40, 1600, 80, 4000, 8
SHAPES = [(10, 10), (10,), (20, 20), (20,), (1000,), (2,)]


def plan(bucket_bytes=None, scope="layer", compressor=None):
    pipeline = GradientPipeline(
        compressor or tfs.TopK(ratio=0.1), scope=scope, bucket_bytes=bucket_bytes
    )
    return pipeline, pipeline.plan(SHAPES, [tf.float32] * len(SHAPES))


def test_buckets_fill_in_backprop_order_and_close_at_bucket_bytes():
    _, units = plan(bucket_bytes=1700)
    assert [u.indices for u in units] == [(i,) for i in range(len(SHAPES))]  # variable order
    # backprop order, closing a bucket once it holds 1700 bytes or more (as DDP does):
    # (2,) 8 + (1000,) 4000 | (20,) 80 + (20, 20) 1600 + (10,) 40 | (10, 10) 400
    assert [u.bucket for u in units] == [2, 1, 1, 1, 0, 0]


def test_default_bucket_holds_small_models_whole_and_config_round_trips():
    pipeline, units = plan()
    assert pipeline.options.bucket_bytes == DEFAULT_BUCKET_BYTES
    assert {u.bucket for u in units} == {0}
    assert "bucket_bytes" not in pipeline.get_config()  # older configs stay as they were
    custom, _ = plan(bucket_bytes=512)
    assert custom.get_config()["bucket_bytes"] == 512
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), bucket_bytes=512)
    again = tfs.SparsifiedOptimizer.from_config(opt.get_config())
    assert again.pipeline.options.bucket_bytes == 512


def test_global_scope_is_one_unit_per_dtype():
    _, units = plan(bucket_bytes=100, scope="global")
    assert len(units) == 1 and units[0].indices == tuple(range(len(SHAPES)))


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "big"])
def test_bad_bucket_bytes_name_the_argument(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        GradientPipeline(tfs.TopK(k=1), bucket_bytes=bad)


class RecordingCollective(LocalCollective):
    """A local collective that records the tensors of every transfer."""

    def __init__(self):
        self.calls: list[list[tf.Tensor]] = []

    def all_reduce_sum(self, tensors):
        if tensors:
            self.calls.append(list(tensors))
        return super().all_reduce_sum(tensors)

    def all_gather(self, tensors):
        if tensors:
            self.calls.append(list(tensors))
        return super().all_gather(tensors)


def ancestors(tensor: tf.Tensor) -> set[str]:
    """Names of the placeholder ops ``tensor`` depends on in its graph."""
    seen, stack, found = set(), [tensor.op], set()
    while stack:
        op = stack.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.type == "Placeholder":
            found.add(op.name)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return found


def traced_transfers(pipeline, units) -> tuple[list[list[tf.Tensor]], list[str]]:
    """Trace one step on placeholder gradients; the tensors of each transfer, and the
    placeholders' names by variable."""
    collective = RecordingCollective()
    names = [f"g{i}" for i in range(len(SHAPES))]
    specs = [tf.TensorSpec(s, tf.float32, name=n) for s, n in zip(SHAPES, names, strict=True)]

    @tf.function(input_signature=specs)
    def step(*grads):
        residuals = [tf.zeros(s) for s in SHAPES]
        return pipeline.run(
            units, list(grads), StepMemory(residuals, tf.constant(0)), collective
        ).updates

    step.get_concrete_function()
    return collective.calls, names


def owners(call: list[tf.Tensor], units, names: list[str]) -> set[int]:
    """The buckets whose gradients a transfer depends on."""
    sources = set().union(*(ancestors(t) for t in call))
    return {u.bucket for u in units if any(names[i] in sources for i in u.indices)}


@pytest.mark.parametrize(
    "compressor", [tfs.TopK(ratio=0.1), tfs.FP16(), tfs.QSGD(levels=4)], ids=repr
)
def test_each_bucket_travels_once_and_depends_only_on_its_own_gradients(compressor):
    pipeline, units = plan(bucket_bytes=1700, compressor=compressor)
    calls, names = traced_transfers(pipeline, units)
    buckets = sorted({u.bucket for u in units})
    assert len(calls) == len(buckets)  # one transfer per bucket
    assert sorted(tuple(owners(call, units, names)) for call in calls) == [(b,) for b in buckets]


def test_local_clipping_makes_every_transfer_wait_for_every_gradient():
    """Documented: local_clipnorm needs the norm of all gradients, so it cannot overlap."""
    pipeline = GradientPipeline(tfs.TopK(ratio=0.1), bucket_bytes=1700, local_clipnorm=1.0)
    units = pipeline.plan(SHAPES, [tf.float32] * len(SHAPES))
    calls, names = traced_transfers(pipeline, units)
    for call in calls:
        assert owners(call, units, names) == {u.bucket for u in units}


# -- per-bucket non-finite agreement under MirroredStrategy ------------------------------------
def mirrored_step(strategy, compressor, poison_replica: int, poison_var: int, bucket_bytes: int):
    """Two exchanges on 2 replicas, the second with a NaN in one replica's gradient of one
    variable; returns, per update and for the step, whether each replica saw it finite, and
    the per-replica residuals before and after the bad step."""
    shapes = [(30,), (40,)]
    with strategy.scope():
        variables = [keras.Variable(tf.zeros(s)) for s in shapes]
        opt = tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(1.0), compressor, error_feedback=True, bucket_bytes=bucket_bytes
        )
        opt.build(variables)
    rng = np.random.default_rng(3)

    def grads_of_replicas() -> list[list[tf.Tensor]]:
        return [[tf.constant(rng.normal(size=s), tf.float32) for s in shapes] for _ in range(2)]

    @tf.function
    def run(by_replica):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.gather(tf.stack([by_replica[0][i], by_replica[1][i]]), r) for i in (0, 1)]
            result = opt.compression_step(grads, opt.collective())
            return [tf.reduce_all(tf.math.is_finite(u)) for u in result.updates] + [result.finite]

        return strategy.run(replica_fn)

    run(grads_of_replicas())  # the residuals become non-zero
    bad = grads_of_replicas()
    bad[poison_replica][poison_var] = tf.tensor_scatter_nd_update(
        bad[poison_replica][poison_var], [[5]], [float("nan")]
    )
    before = [
        [t.numpy() for t in strategy.experimental_local_results(r.value)] for r in opt.residuals
    ]
    flags = run(bad)
    after = [
        [t.numpy() for t in strategy.experimental_local_results(r.value)] for r in opt.residuals
    ]
    per_replica = [[bool(x) for x in strategy.experimental_local_results(f)] for f in flags]
    return per_replica, before, after


@pytest.mark.parametrize(
    "compressor",
    # TopK's payload reveals a NaN; RandomK (with error feedback: ratio > 1/2) marks its payload
    [tfs.TopK(ratio=0.2), tfs.RandomK(ratio=0.6, seed=1)],
    ids=repr,
)
def test_a_non_finite_bucket_on_one_replica_is_non_finite_on_every_replica(mirrored2, compressor):
    # bucket_bytes=150: the (40,) variable (160 bytes) and the (30,) one travel apart
    flags, before, after = mirrored_step(mirrored2, compressor, 1, 0, bucket_bytes=150)
    first_finite, second_finite, step_finite = flags
    assert first_finite == [False, False]  # the poisoned bucket, on both replicas
    assert second_finite == [True, True]  # the other bucket is untouched
    assert step_finite == [False, False]  # both replicas agree the step is bad
    for b, a in zip(before, after, strict=True):
        for replica in range(2):  # residuals kept as they were, on every replica
            np.testing.assert_array_equal(b[replica], a[replica])
        assert np.any(b[0] != 0)
