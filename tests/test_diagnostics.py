"""Diagnostics (norm gap, empirical beta, residual norm and density) and the gradient-norm
record, on known answers."""

from __future__ import annotations

import glob
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives import LocalCollective
from tf_sparsify.core.measurements import gap_bound, summarize, unit_stats
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.step import StepFlags, StepMemory
from tf_sparsify.keras import plot_diagnostics


def test_unit_stats_known_vector():
    row = unit_stats(tf.constant([3.0, 4.0]), tf.constant([3.0, 4.0]), tf.constant([3.0, 0.0]))
    np.testing.assert_array_equal(row.numpy(), [25.0, 25.0, 9.0, 1.0, 9.0])
    row = unit_stats(
        tf.constant([1.0, 0.0]), tf.constant([3.0, 4.0]), tf.constant([3.0, 0.0]), tf.zeros(2)
    )
    np.testing.assert_array_equal(row.numpy(), [1.0, 25.0, 9.0, 1.0, 0.0])


def test_pipeline_measures_error_feedback_steps():
    """TopK(k=1) on [3, 4]: gap 3/5; next step the residual 3 is all that is left, gap 0."""
    pipe = GradientPipeline(tfs.TopK(k=1))
    units = pipe.plan([(2,)], [tf.float32])
    res = pipe.run(
        units,
        [tf.constant([3.0, 4.0])],
        StepMemory([tf.zeros(2)], 0),
        LocalCollective(),
        StepFlags(measure=True),
    )
    np.testing.assert_array_equal(res.stats.numpy(), [[25.0, 25.0, 9.0, 1.0, 9.0]])
    s = summarize(res.stats.numpy(), units, ["w"])
    assert s["norm_gap"] == pytest.approx(0.6)
    assert s["norm_gap/w"] == pytest.approx(0.6)
    assert s["norm_gap_bound"] == pytest.approx(math.sqrt(0.5))
    assert s["residual_norm"] == pytest.approx(3.0)
    assert s["grad_norm"] == pytest.approx(5.0)
    assert s["density"] == pytest.approx(0.5)
    assert "beta" not in s  # TopK is not an unbiased quantizer
    res2 = pipe.run(
        units,
        [tf.zeros(2)],
        StepMemory(res.residuals, 1),
        LocalCollective(),
        StepFlags(measure=tf.constant(True)),
    )
    np.testing.assert_array_equal(res2.stats.numpy(), [[0.0, 9.0, 0.0, 1.0, 0.0]])
    s2 = summarize(res2.stats.numpy(), units, ["w"])
    assert s2["norm_gap"] == 0.0 and s2["grad_norm_gap"] == 0.0 and s2["grad_norm"] == 0.0
    # a fresh [1, 0.5] on top of the residual [3, 0]: TopK sends 4; alone it would send 1
    res3 = pipe.run(
        units,
        [tf.constant([1.0, 0.5])],
        StepMemory(res.residuals, 2),
        LocalCollective(),
        StepFlags(measure=True),
    )
    np.testing.assert_allclose(res3.stats.numpy(), [[1.25, 16.25, 0.25, 1.0, 0.25]])
    s3 = summarize(res3.stats.numpy(), units, ["w"])
    assert s3["norm_gap"] == pytest.approx(math.sqrt(0.25 / 16.25))
    assert s3["grad_norm_gap"] == pytest.approx(math.sqrt(0.25 / 1.25))
    off = pipe.run(
        units,
        [tf.constant([1.0, 2.0])],
        StepMemory([tf.zeros(2)], 2),
        LocalCollective(),
        StepFlags(measure=False),
    )
    np.testing.assert_array_equal(off.stats.numpy(), np.zeros((1, 5)))
    assert (
        pipe.run(units, [tf.ones(2)], StepMemory([tf.zeros(2)], 3), LocalCollective()).stats is None
    )


def test_summary_whole_model_and_dense_units():
    """Two TopK units and one dense (min_size) unit: global gap over everything."""
    pipe = GradientPipeline(tfs.TopK(k=1), min_size=3)
    units = pipe.plan([(4,), (2,), (3,)], [tf.float64] * 3)
    grads = [
        tf.constant([1.0, 0.0, -2.0, 2.0], tf.float64),  # tie 2 vs -2: lowest index kept
        tf.constant([5.0, 1.0], tf.float64),  # dense
        tf.constant([0.0, 0.0, 0.0], tf.float64),  # all zero
    ]
    residuals = [tf.zeros(4, tf.float64), None, tf.zeros(3, tf.float64)]
    res = pipe.run(
        units, grads, StepMemory(residuals, 0), LocalCollective(), StepFlags(measure=True)
    )
    np.testing.assert_array_equal(
        res.stats.numpy(),
        [[9.0, 9.0, 5.0, 1.0, 5.0], [26.0, 26.0, 0.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]],
    )
    s = summarize(res.stats.numpy(), units, ["a", "b", "c"])
    assert s["norm_gap/a"] == pytest.approx(math.sqrt(5 / 9))
    assert s["norm_gap/b"] == 0.0 and s["norm_gap_bound/b"] == 0.0
    assert s["norm_gap/c"] == 0.0  # zero vector: gap defined as 0
    assert s["norm_gap_bound/a"] == pytest.approx(math.sqrt(3 / 4))
    assert s["norm_gap_bound/c"] == pytest.approx(math.sqrt(2 / 3))
    assert s["norm_gap"] == pytest.approx(math.sqrt(5 / 35))
    assert s["norm_gap_bound"] == pytest.approx(math.sqrt(3 / 4))
    assert s["density"] == pytest.approx(3 / 9)
    assert s["wire_density"] == pytest.approx(4 / 9)  # TopK promises k=1 of the zero vector too
    assert "residual_norm/b" not in s and s["residual_norm"] == pytest.approx(math.sqrt(5))
    assert gap_bound(tfs.FP16(), 10) == pytest.approx(2**-11)  # normal-range rounding
    assert gap_bound(tfs.RandomK(0.1), 10) == pytest.approx(3.0)  # sqrt(beta)


def test_empirical_beta_randomk_known_answer():
    """RandomK keeping 2 of 4 equal entries: ||Q(v) - v||^2 = 4 = (d/k - 1) ||v||^2 exactly."""
    pipe = GradientPipeline(tfs.RandomK(0.5, seed=1))
    units = pipe.plan([(4,)], [tf.float32])
    for step in range(3):
        res = pipe.run(
            units,
            [tf.ones(4)],
            StepMemory([None], step),
            LocalCollective(),
            StepFlags(measure=True),
        )
        s = summarize(res.stats.numpy(), units, ["v"])
        assert s["beta/v"] == pytest.approx(1.0) and s["beta_bound/v"] == 1.0
        assert s["beta"] == pytest.approx(1.0) and s["density"] == 0.5
        assert "residual_norm/v" not in s


def test_empirical_beta_exact_quantizers_and_mean_below_bound():
    """TernGrad is exact on entries of equal magnitude, QSGD on a one-hot vector; RandomK's
    mean beta on a random vector is its bound d/k - 1 (equality in expectation)."""
    cases = [
        (tfs.TernGrad(seed=2), tf.constant([1.0, -1.0, 1.0, -1.0])),
        (tfs.QSGD(levels=1, seed=2), tf.constant([0.0, -2.0, 0.0, 0.0])),
    ]
    for comp, v in cases:
        pipe = GradientPipeline(comp)
        units = pipe.plan([(4,)], [tf.float32])
        res = pipe.run(
            units, [v], StepMemory([None], 5), LocalCollective(), StepFlags(measure=True)
        )
        s = summarize(res.stats.numpy(), units)
        assert s["beta"] == pytest.approx(0.0, abs=1e-12)
        assert s["beta_bound"] == comp.variance_bound(4)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal(50), tf.float32)
    pipe = GradientPipeline(tfs.RandomK(0.2, seed=3))
    units = pipe.plan([(50,)], [tf.float32])
    stats = tf.function(
        lambda t: (
            pipe.run(
                units, [x], StepMemory([None], t), LocalCollective(), StepFlags(measure=True)
            ).stats
        )
    )
    betas = [summarize(stats(tf.constant(t)).numpy(), units)["beta"] for t in range(100)]
    assert np.mean(betas) == pytest.approx(4.0, rel=0.1)  # d/k - 1 = 50/10 - 1


def _fit(optimizer, callbacks, epochs=3, strategy=None, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((96, 12)).astype("float32")
    y = (x[:, :3].sum(axis=1) > 0).astype("int32")
    keras.utils.set_random_seed(seed)
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(20, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    hist = model.fit(x, y, batch_size=16, epochs=epochs, verbose=0, callbacks=callbacks)
    return model, hist.history


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_callback_records_every_n_steps_and_fills_history(tmp_path):
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.05))
    diag = tfs.CompressionDiagnostics(every_n_steps=4, log_dir=str(tmp_path), per_layer=True)
    _, hist = _fit(opt, [diag], epochs=3)  # 6 steps per epoch, 18 steps
    assert [r["step"] for r in diag.records] == [1, 5, 9, 13, 17]
    assert [r["epoch"] for r in diag.records] == [0, 0, 1, 2, 2]
    assert opt.diagnostics_every == 4 and int(opt.diagnostics_step.numpy()) == 17
    for r in diag.records:
        for name in opt.diagnostics_names:
            assert r[f"norm_gap/{name}"] <= r[f"norm_gap_bound/{name}"] + 1e-6
        assert 0 < r["norm_gap"] <= r["norm_gap_bound"] + 1e-6
        assert r["residual_norm"] > 0
    k = [tfs.TopK(0.05).num_selected(n) for n in (240, 20, 40, 2)]
    assert diag.records[-1]["density"] == pytest.approx(sum(k) / 302)
    # epoch logs: mean of the epoch's records
    assert hist["norm_gap"][0] == pytest.approx(np.mean([r["norm_gap"] for r in diag.records[:2]]))
    assert hist["norm_gap"][1] == pytest.approx(diag.records[2]["norm_gap"])
    assert f"norm_gap/{opt.diagnostics_names[0]}" in hist
    assert diag.history["step"] == [1.0, 5.0, 9.0, 13.0, 17.0]

    events = glob.glob(os.path.join(str(tmp_path), "events.out.tfevents.*"))
    assert events
    seen = {}
    for path in events:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                seen.setdefault(value.tag, []).append(
                    (event.step, float(tf.make_ndarray(value.tensor)))
                )
    assert [s for s, _ in seen["diagnostics/norm_gap"]] == [1, 5, 9, 13, 17]
    np.testing.assert_allclose(
        [v for _, v in seen["diagnostics/norm_gap"]],
        [r["norm_gap"] for r in diag.records],
        rtol=1e-6,
    )
    assert f"diagnostics/norm_gap/{opt.diagnostics_names[2]}" in seen

    png = plot_diagnostics(diag, str(tmp_path / "diag.png"), title="test")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_callback_enables_diagnostics_on_a_built_optimizer():
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.1))
    model, _ = _fit(opt, [], epochs=1)
    assert opt.diagnostics is None
    diag = tfs.CompressionDiagnostics(every_n_steps=2)
    x = np.ones((32, 12), "float32")
    model.fit(x, np.zeros(32, "int32"), batch_size=16, epochs=1, verbose=0, callbacks=[diag])
    assert opt.diagnostics is not None
    assert [r["step"] for r in diag.records] == [7]  # steps 6 and 7 done; 6 % 2 == 0


def test_unbiased_quantizer_beta_in_keras_is_below_bound_on_average():
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.QSGD(levels=4, seed=1))
    diag = tfs.CompressionDiagnostics(every_n_steps=1)
    _, hist = _fit(opt, [diag], epochs=2)
    assert "beta" in hist
    assert not any(k.startswith("residual_norm/") for k in diag.records[0])
    betas = [r["beta"] for r in diag.records]
    assert len(betas) == 12 and 0 < np.mean(betas) <= diag.records[0]["beta_bound"]
    assert diag.records[0]["beta_bound"] == tfs.QSGD(4).variance_bound(240)


def test_diagnostics_under_mirrored_strategy(mirrored2):
    """Each replica measures its own step; the record is the mean over the two replicas."""
    with mirrored2.scope():  # the step counter must be a mirrored variable
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.1))
    diag = tfs.CompressionDiagnostics(every_n_steps=3)
    _fit(opt, [diag], epochs=2, strategy=mirrored2)
    assert [r["step"] for r in diag.records] == [1, 4, 7, 10]
    k = [tfs.TopK(0.1).num_selected(n) for n in (240, 20, 40, 2)]
    for r in diag.records:
        assert r["density"] == pytest.approx(sum(k) / 302)
        assert 0 < r["norm_gap"] <= r["norm_gap_bound"] + 1e-6
    assert opt.diagnostics.numpy().shape == (4, 5)


def test_diagnostics_validation():
    with pytest.raises(ValueError, match="every_n_steps"):
        tfs.CompressionDiagnostics(every_n_steps=0)
    with pytest.raises(ValueError, match="diagnostics_every"):
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.1), diagnostics_every=-1)
    with pytest.raises(ValueError, match="at least one record"):
        plot_diagnostics([], "unused.png")


def _one_step_on_two_replicas(strategy, opt, var) -> None:
    """A step where replica 0's gradient is [[3, 4], [0, 0]] and replica 1's [[1, 0], [0, 0]]."""

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            first = tf.equal(ctx.replica_id_in_sync_group, 0)
            g = tf.where(first, [[3.0, 4.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]])
            opt.apply([g], [var])

        strategy.run(replica_fn)

    step()


def test_diagnostics_record_is_the_mean_over_replicas(mirrored2):
    with mirrored2.scope():
        var = keras.Variable(np.zeros((2, 2), "float32"))
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=1), diagnostics_every=1)
        opt.build([var])

    _one_step_on_two_replicas(mirrored2, opt, var)
    # replica 0: [25, 25, 9, 1, 9]; replica 1: [1, 1, 0, 1, 0]
    np.testing.assert_allclose(opt.diagnostics.numpy(), [[13.0, 13.0, 4.5, 1.0, 4.5]])
    assert int(opt.diagnostics_step.numpy()) == 1


def _three_variables() -> list[keras.Variable]:
    return [keras.Variable(np.zeros(s, "float32")) for s in ((20, 10), (10,), (10, 5))]


def _apply_step(opt, variables: list) -> tf.types.experimental.GenericFunction:
    @tf.function
    def step(grads):
        opt.apply(grads, variables)

    return step


def test_grad_sq_norms_are_recorded_every_n_steps_and_change_nothing_else(tmp_path):
    """Every 3 steps each unit's ||g||^2 (summed in float32), at no change to the step:
    weights and residuals bit for bit as without the record (TopK's packed route stays). A
    checkpoint with the record restores into an optimizer without it (a record, not state)."""
    rng = np.random.default_rng(4)
    grads = [[rng.normal(size=s).astype("float32") for s in ((20, 10), (10,), (10, 5))]]
    grads += [[rng.normal(size=g.shape).astype("float32") for g in grads[0]] for _ in range(6)]
    runs = []
    for every in (0, 3):
        variables = _three_variables()
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1))
        opt.enable_grad_sq_norms(every)
        opt.build(variables)
        step = _apply_step(opt, variables)
        for g in grads:
            step([tf.constant(x) for x in g])
        runs.append((opt, variables))
    (plain, plain_vars), (opt, variables) = runs
    assert plain.grad_sq_norms is None and opt.grad_sq_norms_every == 3
    for a, b in zip(plain_vars + plain.residuals, variables + opt.residuals, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(opt.grad_sq_norms_step.numpy()) == 7  # written at steps 0, 3 and 6
    want = [sum(np.sum(np.square(grads[6][i])) for i in u.indices) for u in opt.units]
    np.testing.assert_allclose(opt.grad_sq_norms.numpy()[:, 0], want, rtol=1e-6)
    path = tf.train.Checkpoint(optimizer=opt).write(str(tmp_path / "ckpt"))
    fresh = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1))
    fresh.build(_three_variables())
    tf.train.Checkpoint(optimizer=fresh).read(path)
    for a, b in zip(fresh.residuals, opt.residuals, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="grad_sq_norms_every"):
        fresh.enable_grad_sq_norms(-1)
    opt.enable_grad_sq_norms(0)  # off again, from the next trace: the record stays as it was
    retraced = _apply_step(opt, variables)
    for g in grads[:3]:  # steps 7 to 9: every 3 steps would write at step 9
        retraced([tf.constant(x) for x in g])
    assert int(opt.grad_sq_norms_step.numpy()) == 7


def test_grad_sq_norms_are_the_mean_over_replicas(mirrored2):
    with mirrored2.scope():
        var = keras.Variable(np.zeros((2, 2), "float32"))
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=1))
        opt.build([var])
        opt.enable_grad_sq_norms(1)  # a built optimizer makes the record here

    _one_step_on_two_replicas(mirrored2, opt, var)
    np.testing.assert_array_equal(opt.grad_sq_norms.numpy(), [[13.0]])  # (25 + 1) / 2
    assert int(opt.grad_sq_norms_step.numpy()) == 1


@pytest.mark.example
def test_topk_study_quick_run(tmp_path):
    """The study script end to end on its smallest setting: files, table, and the paper's
    qualitative result that error feedback beats no error feedback at K = 0.1%."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "topk_study.py")
    spec = importlib.util.spec_from_file_location("topk_study", path)
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    out = str(tmp_path / "study")
    results = study.main(["--quick", "--epochs", "2", "--tasks", "logreg", "--out", out])
    for name in ("table.md", "results.json", "norm_gap_vs_k.png", "convergence.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    assert len(results) == 8 and all(r["epochs"] == 2 for r in results)
    by = {(r["k"], r["ef"]): r for r in results}
    assert by[(0.001, True)]["loss"][-1] < by[(0.001, False)]["loss"][-1]
    for r in results:
        if r["k"] is not None:  # TopK's worst case; PowerSGD (k None) declares none
            assert r["norm_gap_max"] <= r["norm_gap_bound"] + 1e-6
    # PowerSGD rank 1: P and Q of the 64x10 kernel, the bias dense
    assert by[(None, True)]["bytes_per_step"][-1] == 4 * (64 + 10 + 10)
    assert by[(1.0, False)]["bytes_per_step"][-1] == 4 * 650
    # ceil(1% of 650) float32 values + their 8-byte index code
    assert by[(0.01, True)]["bytes_per_step"][-1] == 4 * 7 + 8
