"""PowerSGD: exact updates, residuals and Q against NumPy on 1 and 2 replicas, warm start,
checkpoints, conservation, bytes, dense fallbacks, bad input, non-finite steps, float16 near its
largest value, training."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tests.powersgd_reference import numpy_powersgd, orthonormal, seeded_q
from tests.test_optimizer import X, Y, checkpoint_run, compile_fit
from tf_sparsify.collectives import LocalCollective, ReplicaContextCollective
from tf_sparsify.compressors import deserialize, serialize
from tf_sparsify.compressors.base import check_contraction
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import bytes_per_step
from tf_sparsify.core.step import StepFlags, StepMemory
from tf_sparsify.distribute import DelayedGradients, ServerOptimizer

# compressed as 12x5, compressed as 12x6, a vector, a matrix where rank 2 does not pay
SHAPES = [(12, 5), (4, 3, 6), (5,), (3, 3)]
COMPRESSED = (0, 1)
RANK = 2


def make_grads(steps: int, replicas: int, seed: int = 0) -> list[np.ndarray]:
    """Per tensor, ``[steps, replicas, *shape]`` float64 gradients."""
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(steps, replicas, *s)) for s in SHAPES]


def zero_states(units) -> list[tuple[tf.Tensor, ...]]:
    return [
        tuple(tf.zeros(shape, dtype) for shape, dtype in u.compressor.state_specs(u.shape, u.dtype))
        for u in units
    ]


def local_run(pipeline: GradientPipeline, grads: list[np.ndarray], dtype=tf.float64):
    """Drive the pipeline on one replica like a front end; per step (updates, residuals,
    states, finite)."""
    units = pipeline.plan(SHAPES, [dtype] * len(SHAPES))
    residuals = [tf.zeros(s, dtype) for s in SHAPES]
    states = zero_states(units)
    steps = []
    for t in range(grads[0].shape[0]):
        out = pipeline.run(
            units,
            [tf.constant(g[t, 0], dtype) for g in grads],
            StepMemory(residuals, tf.constant(t, tf.int64), states=states),
            LocalCollective(),
        )
        residuals = [r if n is None else n for r, n in zip(residuals, out.residuals, strict=True)]
        states = out.states
        steps.append((out.updates, residuals, states, bool(out.finite)))
    return steps


def mirrored_run(strategy, pipeline: GradientPipeline, grads: list[np.ndarray]):
    """The same on the 2 replicas of ``strategy``; per step, per replica (updates, residuals,
    states, finite)."""
    units = pipeline.plan(SHAPES, [tf.float64] * len(SHAPES))

    @tf.function
    def step(t, g, e, s):
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            r = ctx.replica_id_in_sync_group
            out = pipeline.run(
                units,
                [x[r] for x in g],
                StepMemory([x[r] for x in e], t, states=[tuple(x[r] for x in st) for st in s]),
                ReplicaContextCollective(ctx),
            )
            return out.updates, out.residuals, out.states, out.finite

        return strategy.run(replica_fn)

    def local(nest):
        leaves = [strategy.experimental_local_results(x) for x in tf.nest.flatten(nest)]
        return [tf.nest.pack_sequence_as(nest, [x[r] for x in leaves]) for r in range(2)]

    residuals = [tf.zeros((2, *s), tf.float64) for s in SHAPES]
    states = [tuple(tf.stack([x, x]) for x in st) for st in zero_states(units)]
    steps = []
    for t in range(grads[0].shape[0]):
        per_replica = local(
            step(tf.constant(t, tf.int64), [g[t] for g in grads], residuals, states)
        )
        steps.append(per_replica)
        residuals = [tf.stack([r[1][i] for r in per_replica]) for i in range(len(SHAPES))]
        states = [
            tuple(tf.stack([r[2][u][j] for r in per_replica]) for j in range(len(st)))
            for u, st in enumerate(states)
        ]
    return steps


def test_one_replica_matches_numpy_over_steps():
    grads = make_grads(4, 1)
    steps = local_run(GradientPipeline(tfs.PowerSGD(RANK, seed=3)), grads)
    for i in COMPRESSED:
        expected = numpy_powersgd(grads[i], RANK, divisor=1.0, seed=3, tensor_id=i)
        for t, ((update, residual, q), (updates, residuals, states, finite)) in enumerate(
            zip(expected, steps, strict=True)
        ):
            assert finite
            np.testing.assert_allclose(updates[i].numpy(), update, atol=1e-10, err_msg=f"{t}")
            np.testing.assert_allclose(residuals[i].numpy(), residual[0], atol=1e-10)
            np.testing.assert_allclose(states[i][0].numpy(), q, atol=1e-10)


def test_two_replicas_match_numpy_and_agree(mirrored2):
    grads = make_grads(3, 2, seed=1)
    steps = mirrored_run(mirrored2, GradientPipeline(tfs.PowerSGD(RANK)), grads)
    for i in COMPRESSED:
        # Keras' losses are already divided by the replica count: the collective sums
        expected = numpy_powersgd(grads[i], RANK, divisor=1.0, tensor_id=i)
        for t, ((update, residuals, q), replicas) in enumerate(zip(expected, steps, strict=True)):
            for r, (updates, got_residuals, states, finite) in enumerate(replicas):
                assert bool(finite)
                np.testing.assert_allclose(updates[i].numpy(), update, atol=1e-10)
                np.testing.assert_allclose(got_residuals[i].numpy(), residuals[r], atol=1e-10)
                np.testing.assert_allclose(states[i][0].numpy(), q, atol=1e-10)
            first, second = (rep[0][i].numpy() for rep in replicas)
            np.testing.assert_array_equal(first, second, err_msg=f"replicas differ at step {t}")


def test_conservation_float64_on_two_replicas(mirrored2):
    """Per step, ``divisor * update + sum_r e_r == sum_r (g_r + e_r before)``: the replicas'
    projections add up to the projection of their sum. Over all steps, the updates applied plus
    the residuals left are exactly the gradients (divisor 1 under tf.distribute)."""
    grads = make_grads(5, 2, seed=2)
    steps = mirrored_run(mirrored2, GradientPipeline(tfs.PowerSGD(1)), grads)
    for i in range(len(SHAPES)):
        before = np.zeros_like(grads[i][0])
        for t, replicas in enumerate(steps):
            after = np.stack([replica[1][i].numpy() for replica in replicas])
            kept = replicas[0][0][i].numpy() + after.sum(axis=0)
            np.testing.assert_allclose(kept, (grads[i][t] + before).sum(axis=0), atol=1e-12)
            before = after
        applied = sum(step[0][0][i].numpy() for step in steps)  # the same on both replicas
        left = steps[-1][0][1][i].numpy() + steps[-1][1][1][i].numpy()
        np.testing.assert_allclose(applied + left, grads[i].sum(axis=(0, 1)), atol=1e-11)
    assert np.abs(steps[-1][0][1][0].numpy()).max() > 0.1  # the residual holds something


def test_warm_start_keeps_q_and_draws_only_its_zero_columns():
    """A column of Q that is all zero is drawn from (seed, step, tensor); others carry over."""
    rng = np.random.default_rng(4)
    g = rng.normal(size=(12, 5))
    kept = rng.normal(size=5)
    pipeline = GradientPipeline(tfs.PowerSGD(2, seed=7), error_feedback=False)
    units = pipeline.plan([(12, 5)], [tf.float64])

    def run(step, q):
        out = pipeline.run(
            units,
            [tf.constant(g)],
            StepMemory([None], tf.constant(step, tf.int64), states=[(tf.constant(q),)]),
            LocalCollective(),
        )
        return out.updates[0].numpy(), out.states[0][0].numpy()

    q = np.stack([kept, np.zeros(5)], axis=1)
    update, new_q = run(3, q)
    used = np.stack([kept, seeded_q(5, 2, 7, 3, 0, tf.float64)[:, 1]], axis=1)
    p_hat = orthonormal(g @ used)
    np.testing.assert_allclose(update, p_hat @ p_hat.T @ g, atol=1e-12)
    np.testing.assert_allclose(new_q, g.T @ p_hat, atol=1e-12)
    # a full Q draws nothing: the step no longer matters
    np.testing.assert_array_equal(run(5, new_q)[0], run(9, new_q)[0])


def test_zero_gradient_gives_zeros_then_a_fresh_draw():
    """M = 0: P = 0 stays 0 through Gram-Schmidt (no NaN), the update, residual and Q are 0,
    and the next step draws Q afresh as on a first step."""
    grads = make_grads(2, 1, seed=5)
    for g in grads:
        g[0] = 0.0
    steps = local_run(GradientPipeline(tfs.PowerSGD(RANK)), grads)
    updates, residuals, states, finite = steps[0]
    assert finite
    for i in COMPRESSED:
        assert not np.any(updates[i].numpy()) and not np.any(residuals[i].numpy())
        assert not np.any(states[i][0].numpy())
        q = seeded_q(grads[i].shape[-1], RANK, 0, 1, i, tf.float64)
        matrix = grads[i][1, 0].reshape(-1, grads[i].shape[-1])
        p_hat = orthonormal(matrix @ q)
        np.testing.assert_allclose(
            steps[1][0][i].numpy().reshape(matrix.shape), p_hat @ p_hat.T @ matrix, atol=1e-10
        )


def test_checkpoint_restore_continues_identically(tmp_path):
    """tf.train.Checkpoint carries Q (and the residuals and step): restore-then-train equals
    training on."""
    straight, resumed, opt = checkpoint_run(tmp_path, tfs.PowerSGD(2), split=4, total=7)
    for a, b in zip(straight.weights, resumed.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    states = [v for v in opt.variables if "_state" in v.name]
    assert [tuple(v.shape) for v in states] == [(16, 2), (3, 2)]
    assert all(np.any(v.numpy()) for v in states)


def test_keras_file_roundtrip_keeps_q_and_continues(tmp_path):
    model, opt = compile_fit(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), tfs.PowerSGD(2))
    )
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.compressor == tfs.PowerSGD(2)
    mine = [v for v in opt.variables if "_state" in v.name]
    theirs = [v for v in loaded.optimizer.variables if "_state" in v.name]
    assert len(mine) == len(theirs) == 2
    for a, b in zip(mine + opt.residuals, theirs + loaded.optimizer.residuals, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    model.train_on_batch(X[:16], Y[:16])
    loaded.train_on_batch(X[:16], Y[:16])
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_bytes_exact_one_all_reduce_per_round_and_flat_in_replicas(mirrored2, monkeypatch):
    """Each replica hands the all-reduce P ([n, r]) with the dense tensors in one call, then
    Q ([m, r]) in a second; no replica axis, so the bytes do not grow with the replicas."""
    calls = []
    original = tf.distribute.ReplicaContext.all_reduce

    def spy(ctx, reduce_op, value, options=None):
        calls.append(tuple(tuple(v.shape) for v in tf.nest.flatten(value)))
        return original(ctx, reduce_op, value, options)

    monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", spy)
    pipeline = GradientPipeline(tfs.PowerSGD(RANK))
    mirrored_run(mirrored2, pipeline, make_grads(1, 2))
    assert set(calls) == {((12, 2), (12, 2), (5,), (3, 3)), ((5, 2), (6, 2))}
    units = pipeline.plan(SHAPES, [tf.float64] * len(SHAPES))
    sent = sum(8 * int(np.prod(shape)) for call in set(calls) for shape in call)
    assert bytes_per_step(units) == (sent, 8 * (60 + 72 + 5 + 9))
    assert sent == 8 * (RANK * (12 + 5) + RANK * (12 + 6) + 5 + 9)
    assert local_run(pipeline, make_grads(1, 1))[0][3]  # same plan, same bytes, one replica


def test_vectors_and_matrices_where_low_rank_does_not_pay_are_sent_dense():
    comp = tfs.PowerSGD(2)
    for shape in [(5,), (3, 3), (2, 40), (0, 4), ()]:
        assert comp.matrix_shape(shape) is None
        assert comp.state_specs(tf.TensorShape(shape), tf.float32) == ()
        assert comp.wire_bytes_for(shape, tf.float32) == 4 * int(np.prod(shape))
    assert comp.matrix_shape((2, 3, 40)) == (6, 40)  # rank >= 2: [prod(shape[:-1]), shape[-1]]
    assert tfs.PowerSGD(1).matrix_shape((3, 3)) == (3, 3)  # 1 * (3 + 3) < 9
    grads = make_grads(2, 1, seed=6)
    steps = local_run(GradientPipeline(comp), grads)
    for t, (updates, residuals, _, _) in enumerate(steps):
        for i in (2, 3):  # exact, nothing left over
            np.testing.assert_array_equal(updates[i].numpy(), grads[i][t, 0])
            assert not np.any(residuals[i].numpy())


def test_sixteen_bit_gradients_are_factored_in_float32():
    comp = tfs.PowerSGD(2)
    assert comp.wire_bytes_for((12, 5), tf.float16) == 2 * 17 * 4
    assert comp.state_specs(tf.TensorShape((12, 5)), tf.bfloat16) == (((5, 2), tf.float32),)
    grads = make_grads(2, 1, seed=7)
    half = local_run(GradientPipeline(comp), grads, tf.float16)
    full = local_run(GradientPipeline(comp), grads, tf.float32)
    for (h, *_), (f, *_) in zip(half, full, strict=True):
        assert h[0].dtype == tf.float16
        np.testing.assert_allclose(h[0].numpy(), f[0].numpy(), rtol=2e-2, atol=2e-2)


def test_error_feedback_is_on_by_default_and_allowed_without_a_contraction():
    pipeline = GradientPipeline(tfs.PowerSGD(1))
    assert pipeline.options.error_feedback and tfs.PowerSGD(1).contraction(60) is None
    assert pipeline.needs_residual(pipeline.plan([(12, 5)], [tf.float32]), 1) == [True]
    assert check_contraction(tfs.PowerSGD(1), 60) is None
    with pytest.raises(ValueError, match="error_feedback"):  # other compressors still checked
        GradientPipeline(tfs.RandomK(0.1), error_feedback=True).plan([(12, 5)], [tf.float32])
    off = GradientPipeline(tfs.PowerSGD(1), error_feedback=False)
    assert off.needs_residual(off.plan([(12, 5)], [tf.float32]), 1) == [False]


@pytest.mark.parametrize("rank", [0, -1, 1.5, True, "2", None])
def test_bad_rank_is_named(rank):
    with pytest.raises(ValueError, match="rank"):
        tfs.PowerSGD(rank)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="seed"):
        tfs.PowerSGD(1, seed=-1)
    with pytest.raises(ValueError, match="scope"):
        GradientPipeline(tfs.PowerSGD(1), scope="global")
    with pytest.raises(ValueError, match="momentum_correction"):
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.PowerSGD(1), momentum_correction=0.9)
    pipeline = GradientPipeline(tfs.PowerSGD(1))
    units = pipeline.plan([(12, 5)], [tf.float32])
    with pytest.raises(ValueError, match="per_replica"):
        pipeline.run(
            units,
            [tf.ones((12, 5))],
            StepMemory([tf.zeros((12, 5))], 0, states=zero_states(units)),
            LocalCollective(),
            StepFlags(per_replica=True),
        )
    with pytest.raises(ValueError, match="state"):  # a front end that keeps no Q
        pipeline.run(
            units, [tf.ones((12, 5))], StepMemory([tf.zeros((12, 5))], 0), LocalCollective()
        )
    opt = ServerOptimizer(keras.optimizers.SGD(0.1), tfs.PowerSGD(1), server=DelayedGradients(1))
    v = keras.Variable(tf.zeros((12, 5)))
    with pytest.raises(ValueError, match="per_replica"):
        opt.apply([tf.ones((12, 5))], [v])
    # a multi-round exchange, not a codec: it has no compress() to call alone
    assert isinstance(tfs.PowerSGD(1), tfs.compressors.MultiRoundMethod)
    assert not hasattr(tfs.PowerSGD(1), "compress")


def test_config_registry_and_repr():
    comp = tfs.PowerSGD(4, seed=3)
    assert repr(comp) == "PowerSGD(rank=4, seed=3)"
    assert comp.get_config() == {"rank": 4, "seed": 3}
    assert deserialize(json.loads(json.dumps(serialize(comp)))) == comp
    assert tfs.PowerSGD.from_config(comp.get_config()) == comp != tfs.PowerSGD(4)
    assert isinstance(tfs.compressors.PowerSGD(np.int64(2)).rank, int)
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), comp)
    again = tfs.SparsifiedOptimizer.from_config(opt.get_config())
    assert again.compressor == comp


def test_a_non_finite_gradient_on_one_replica_is_agreed_and_keeps_the_state(mirrored2):
    """NaN on replica 0 makes the summed P non-finite on both replicas: both see a bad step,
    and the optimizer keeps Q and the residuals as they were."""
    with mirrored2.scope():
        v = keras.Variable(tf.zeros([10, 4]))
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(1.0), tfs.PowerSGD(1))
        opt.build([v])
    raw = tf.random.stateless_normal([2, 10, 4], seed=[5, 6])

    @tf.function
    def step(poison):
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            bad = tf.logical_and(poison, tf.equal(r, 0))
            g = tf.where(bad, tf.fill([10, 4], float("nan")), raw[r])
            opt.apply_gradients([(g, v)])

        mirrored2.run(replica_fn)

    def kept():
        (q,) = (x for x in opt.variables if "_state" in x.name)
        return [
            x.numpy()
            for var in (q, opt.residuals[0])
            for x in mirrored2.experimental_local_results(var.value)
        ]

    step(tf.constant(False))
    before = kept()
    assert all(np.all(np.isfinite(x)) and np.any(x) for x in before)
    step(tf.constant(True))
    for a, b in zip(before, kept(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.all(np.isfinite(v.numpy()))  # the update went on, non-finite


# -- float16 near 65504: residual and update rounded once from float32; a step whose residual
# or update does not fit float16 is a non-finite step -----------------------------------------
F16_SHAPE = (8, 6)  # compressed by PowerSGD(2): 2 * (8 + 6) < 48


def _state(opt: tfs.SparsifiedOptimizer) -> list[np.ndarray]:
    """The optimizer's residual and PowerSGD's Q."""
    (q,) = (x for x in opt.variables if "_state" in x.name)
    return [opt.residuals[0].numpy().copy(), q.numpy().copy()]


def _overflowing_gradient() -> np.ndarray:
    """Finite float16 entries of +-65000 in random signs: the rank-2 approximations PowerSGD
    finds for them (seeded, so the same every run) have entries beyond 65504."""
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=F16_SHAPE)
    return (signs * 65000).astype(np.float16)


def test_powersgd_float16_overflow_is_a_non_finite_step_that_keeps_the_memory():
    """Keras wrapper, one replica: a good step, then gradients near float16's max whose rank-2
    approximation overflows float16. That step is bad: residual and Q stay as the good step
    left them (finite), the LossScaleOptimizer inside skips it (weights unchanged, its scale
    halves); before the fix the residual took -Inf/+Inf and kept it."""
    v = keras.Variable(np.zeros(F16_SHAPE, np.float16), dtype="float16")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=1.0)
    opt = tfs.SparsifiedOptimizer(lso, tfs.PowerSGD(2))
    opt.build([v])
    assert opt.residuals[0].dtype == "float16"

    good = tf.random.stateless_normal(F16_SHAPE, seed=[1, 2], dtype=tf.float32) * 100
    opt.apply_gradients([(tf.cast(good, tf.float16), v)])
    before, weights = _state(opt), v.numpy().copy()
    assert all(np.all(np.isfinite(x)) and np.any(x) for x in before)
    assert np.all(np.isfinite(weights)) and np.any(weights)

    opt.apply_gradients([(tf.constant(_overflowing_gradient()), v)])
    after = _state(opt)
    assert all(np.all(np.isfinite(x)) for x in after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(v.numpy(), weights)
    assert float(lso.dynamic_scale.numpy()) == 0.5  # the step was seen as an overflow


def test_powersgd_float16_overflow_through_the_pipeline_is_reported_non_finite():
    """GradientPipeline driven like a front end, several steps from a zero state: every step
    with a finite accumulator whose approximation or residual does not fit float16 reports
    ``finite=False`` with a non-finite update, and a step reported finite never carries a
    non-finite residual (the front end stores residuals only for finite steps)."""
    pipeline = GradientPipeline(tfs.PowerSGD(2))
    units = pipeline.plan([F16_SHAPE], [tf.float16])
    residual = tf.zeros(F16_SHAPE, tf.float16)
    states = zero_states(units)
    grad = _overflowing_gradient()
    bad_steps = 0
    for t in range(4):
        g = tf.constant(grad * (1 if t % 2 == 0 else -1))
        out = pipeline.run(
            units,
            [g],
            StepMemory([residual], tf.constant(t, tf.int64), states=states),
            LocalCollective(),
        )
        update, new_residual = out.updates[0].numpy(), out.residuals[0].numpy()
        if bool(out.finite):
            assert np.all(np.isfinite(new_residual)) and np.all(np.isfinite(update))
            residual, states = out.residuals[0], out.states
        else:
            bad_steps += 1
            assert not np.all(np.isfinite(update))  # marked, as for a non-finite gradient
    assert bad_steps == 4  # every approximation found overflows float16
    assert not np.any(residual.numpy())


def test_powersgd_float16_replica_approximation_beyond_65504_keeps_an_exact_residual(mirrored2):
    """Two replicas, Keras wrapper: ``M_0 = D + S`` and ``M_1 = -D`` with ``D`` = 60000
    everywhere and ``S`` a small rank-2 matrix whose column space is not along ``D``'s. The
    shared subspace is ``S``'s; projected on it, replica 0's ``D`` has entries of 112500 (beyond
    float16) while the update (``S``) and both residuals fit. Before the fix replica 0's
    residual was ``acc - Inf``; now the step is finite, the residuals finite and
    ``update + e_0 + e_1 == M_0 + M_1`` up to float16 rounding."""
    u = np.array([[3, 1, 1, 1, 1, 1, 1, 1], [0, 1, -1, 0, 0, 0, 0, 0]], np.float64).T
    coef = np.array([[1, 2, -1, 0, 1, 3], [2, -1, 1, 3, 0, 1]], np.float64)
    s = 32 * (u @ coef)
    d = np.full(F16_SHAPE, 60000.0)
    grads = np.stack([d + s, -d]).astype(np.float16)
    assert np.array_equal(grads.astype(np.float64), np.stack([d + s, -d]))  # exact in float16
    lr = 2.0**-10
    with mirrored2.scope():
        v = keras.Variable(np.zeros(F16_SHAPE, np.float16), dtype="float16")
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(lr), tfs.PowerSGD(2))
        opt.build([v])
    raw = tf.constant(grads)

    @tf.function
    def step():
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(tf.gather(raw, r), v)])

        mirrored2.run(replica_fn)

    step()
    residuals = [
        x.numpy().astype(np.float64)
        for x in mirrored2.experimental_local_results(opt.residuals[0].value)
    ]
    assert all(np.all(np.isfinite(e)) for e in residuals)
    assert np.abs(residuals[0]).max() > 40000  # replica 0 kept -D's share outside span(S)
    weights = v.numpy().astype(np.float64)
    assert np.all(np.isfinite(weights)) and np.any(weights)
    update = -weights / lr  # Keras sums the replicas' contributions (divisor 1)
    np.testing.assert_allclose(update, s, rtol=0, atol=2.0)  # ~ the sum, projected on S's span
    # e_r rounds once to float16 (spacing 32 near 60000); update's float16 weight adds <= 1
    np.testing.assert_allclose(update + sum(residuals), d + s - d, rtol=0, atol=40.0)


def test_digits_mlp_trains_to_a_sensible_accuracy():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        (x / 16.0).astype("float32"), y, test_size=0.2, random_state=0, stratify=y
    )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.PowerSGD(2))
    model.compile(
        opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    model.fit(x_tr, y_tr, batch_size=32, epochs=5, verbose=0)
    _, accuracy = model.evaluate(x_te, y_te, verbose=0)
    assert accuracy > 0.9  # dense SGD: 0.931 after 5 epochs; PowerSGD without EF: 0.825
    assert opt.wire_bytes_per_step == 4 * (2 * (64 + 64) + 64 + 2 * (64 + 10) + 10)
