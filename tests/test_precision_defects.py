"""Precision edges of error feedback: PowerSGD on float16 accumulators near 65504 (residual and
update rounded once from float32; a step whose residual or update does not fit float16 is a
non-finite step), and TopK's bfloat16 values on float32/float64 accumulators (the rounding
error kept exactly, denormals flushed as documented)."""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives.base import LocalCollective
from tf_sparsify.core.pipeline import GradientPipeline

F16_MAX = 65504.0
SHAPE = (8, 6)  # compressed by PowerSGD(2): 2 * (8 + 6) < 48


def _state(opt: tfs.SparsifiedOptimizer) -> list[np.ndarray]:
    """The optimizer's residual and PowerSGD's Q."""
    (q,) = (x for x in opt.variables if "_state" in x.name)
    return [opt.residuals[0].numpy().copy(), q.numpy().copy()]


def _overflowing_gradient() -> np.ndarray:
    """Finite float16 entries of +-65000 in random signs: the rank-2 approximations PowerSGD
    finds for them (seeded, so the same every run) have entries beyond 65504."""
    signs = np.random.default_rng(0).choice([-1.0, 1.0], size=SHAPE)
    return (signs * 65000).astype(np.float16)


# -- PowerSGD, float16 ---------------------------------------------------------------------------
def test_powersgd_float16_overflow_is_a_non_finite_step_that_keeps_the_memory():
    """Keras wrapper, one replica: a good step, then gradients near float16's max whose rank-2
    approximation overflows float16. That step is bad: residual and Q stay as the good step
    left them (finite), the LossScaleOptimizer inside skips it (weights unchanged, its scale
    halves); before the fix the residual took -Inf/+Inf and kept it."""
    v = keras.Variable(np.zeros(SHAPE, np.float16), dtype="float16")
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3), initial_scale=1.0)
    opt = tfs.SparsifiedOptimizer(lso, tfs.PowerSGD(2))
    opt.build([v])
    assert opt.residuals[0].dtype == "float16"

    good = tf.random.stateless_normal(SHAPE, seed=[1, 2], dtype=tf.float32) * 100
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
    units = pipeline.plan([SHAPE], [tf.float16])
    residual = tf.zeros(SHAPE, tf.float16)
    states = [tuple(tf.zeros(s, d) for s, d in units[0].compressor.state_specs(SHAPE, tf.float16))]
    grad = _overflowing_gradient()
    bad_steps = 0
    for t in range(4):
        g = tf.constant(grad * (1 if t % 2 == 0 else -1))
        out = pipeline.run_step(
            units, [g], [residual], tf.constant(t, tf.int64), LocalCollective(), states=states
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
    d = np.full(SHAPE, 60000.0)
    grads = np.stack([d + s, -d]).astype(np.float16)
    assert np.array_equal(grads.astype(np.float64), np.stack([d + s, -d]))  # exact in float16
    lr = 2.0**-10
    with mirrored2.scope():
        v = keras.Variable(np.zeros(SHAPE, np.float16), dtype="float16")
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


# -- TopK with bfloat16 values --------------------------------------------------------------------
TINY32 = float(np.finfo(np.float32).tiny)  # 2**-126, float32's smallest normal number
BF16 = ml_dtypes.bfloat16
BF16_MAX = float(ml_dtypes.finfo(BF16).max)


def _topk_bf16(acc: np.ndarray, dtype=tf.float32):
    """All entries sent as bfloat16 with error feedback on a zero residual; (sent values in the
    accumulator's dtype, new residual)."""
    comp = tfs.TopK(k=acc.size, value_dtype="bfloat16")
    x = tf.constant(acc, dtype)
    payload, ctx, residual = comp.compress_compensated(x, tf.zeros_like(x))
    assert payload[0].dtype == tf.bfloat16
    return comp.decompress(payload, ctx).numpy(), residual.numpy()


def test_topk_bfloat16_conserves_normal_range_accumulators_exactly():
    """``sent + residual == acc`` bit for bit wherever the rounding error is zero or normal:
    values from float32's smallest normal up (it, its neighbours in bfloat16, values whose
    error is exactly 2**-126), saturated extremes, and random values of every magnitude from
    2**-102 (below it the error of some values is a float32 denormal) to 1e38."""
    rng = np.random.default_rng(0)
    special = [
        TINY32,
        -TINY32,
        TINY32 * (1 + 2.0**-7),  # bfloat16-exact: error 0
        TINY32 * 2**23 * (1 + 2.0**-23),  # error exactly 2**-126: normal, kept
        -TINY32 * 2**23 * (1 + 3 * 2.0**-23),
        float(np.finfo(np.float32).max),  # saturates to bfloat16's max, excess kept
        -float(np.finfo(np.float32).max),
        1.0 + 2.0**-9,  # a tie, rounds to even
        0.0,
    ]
    exponents = rng.uniform(np.log2(2.0**-102), np.log2(1e38), size=4000)
    randoms = rng.choice([-1.0, 1.0], size=4000) * 2.0**exponents
    acc = np.concatenate([special, randoms]).astype(np.float32)
    sent, residual = _topk_bf16(acc)
    rounded = np.clip(acc.astype(BF16).astype(np.float64), -BF16_MAX, BF16_MAX)
    np.testing.assert_array_equal(sent, rounded.astype(np.float32))
    np.testing.assert_array_equal(sent.astype(np.float64) + residual.astype(np.float64), acc)
    assert np.count_nonzero(residual) > 3000  # the rounding errors are really kept
    assert residual[3] == TINY32  # the smallest normal error is kept


def test_topk_bfloat16_flushes_denormal_rounding_errors_and_accumulators():
    """The documented policy: a rounding error below 2**-126 is flushed to zero (the reported
    case: acc = -1.3011386e-38 sends -1.30406e-38 and keeps 0, not -2.9e-41), and an
    accumulator entry below 2**-126 counts as zero (the fused op reads denormals as zero).
    Each loss is below 2**-126; nothing above it is lost."""
    acc = np.array(
        [-1.3011386e-38, TINY32 * (1 + 2.0**-20), 3e-37, -1e-40, TINY32 / 2, 1.0], np.float32
    )
    sent, residual = _topk_bf16(acc)
    error = acc.astype(np.float64) - acc.astype(BF16).astype(np.float64)
    assert np.all(np.abs(error[:3]) < TINY32) and np.all(error[:3] != 0)  # denormal errors
    np.testing.assert_array_equal(sent[:3], acc[:3].astype(BF16).astype(np.float32))
    np.testing.assert_array_equal(sent[3:5], [0, 0])  # denormal accumulators: read as zero
    assert sent[5] == 1.0
    np.testing.assert_array_equal(residual, np.zeros_like(residual))
    assert np.all(np.abs(sent.astype(np.float64) + residual - acc) < TINY32)


def test_topk_bfloat16_on_float64_keeps_errors_below_float32s_range():
    """For float64 accumulators the threshold is float64's smallest normal: the error of
    -1.3011386e-38 (2.9e-41, normal in float64) is kept exactly."""
    acc = np.array([-1.3011386e-38, 1e-300, 1.0 + 2.0**-12], np.float64)
    sent, residual = _topk_bf16(acc, tf.float64)
    assert residual[0] != 0 and abs(residual[0]) < TINY32
    np.testing.assert_array_equal(sent + residual, acc)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_topk_bfloat16_denormal_policy_is_the_same_in_graphs_and_xla(jit_compile):
    """Inside tf.function and XLA (where constant folding or fusion could round otherwise) the
    flushed error and the kept normal one are the same as eagerly."""
    comp = tfs.TopK(k=3, value_dtype="bfloat16")
    acc = np.array([-1.3011386e-38, TINY32 * 2**23 * (1 + 2.0**-23), 2.5 + 2.0**-10], np.float32)

    @tf.function(jit_compile=jit_compile)
    def run(x):
        payload, ctx, residual = comp.compress_compensated(x, tf.zeros_like(x))
        return comp.decompress(payload, ctx), residual

    sent, residual = (t.numpy() for t in run(tf.constant(acc)))
    np.testing.assert_array_equal(residual[0], 0.0)
    np.testing.assert_array_equal(sent[1:].astype(np.float64) + residual[1:], acc[1:])
    assert residual[1] == TINY32 and residual[2] == 2.0**-10
