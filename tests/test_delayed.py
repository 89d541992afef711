"""Delayed updates: ServerOptimizer + DelayedGradients on simulated workers and MirroredStrategy."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.distribute import IAG, DelayedGradients, ServerOptimizer, SimulatedWorkers

P = 3
DIM = 5


def _grads(steps: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(steps, P, DIM)).astype("float32")


def _run(server, grads: np.ndarray, compressor=None):
    """Feed a fixed per-worker gradient sequence to SGD(1); return the applied updates."""
    w = keras.Variable(np.zeros(DIM, "float32"))
    opt = ServerOptimizer(
        keras.optimizers.SGD(1.0), compressor or tfs.Identity(), server, workers=P
    )
    opt.build([w])
    step = tf.function(lambda g: opt.apply([g], [w]))
    deltas, before = [], w.numpy()
    for g in grads:
        step(tf.constant(g))
        deltas.append(before - w.numpy())
        before = w.numpy()
    return np.array(deltas), opt


def _delayed_mean(grads: np.ndarray, delays: np.ndarray) -> np.ndarray:
    """``mean_p grads[t - d[t, p], p]`` with zeros before the first step."""
    out = np.zeros((len(grads), DIM), "float32")
    for t in range(len(grads)):
        for p in range(P):
            if t - delays[t, p] >= 0:
                out[t] += grads[t - delays[t, p], p] / P
    return out


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_fixed_delay_applies_exactly_the_gradient_of_step_t_minus_tau(tau):
    grads = _grads(7)
    deltas, _ = _run(DelayedGradients(tau), grads)
    for t in range(7):
        expected = grads[t - tau].mean(axis=0) if t >= tau else np.zeros(DIM)
        np.testing.assert_allclose(deltas[t], expected, atol=1e-6, err_msg=f"step {t}")


@pytest.mark.parametrize("compressor", [tfs.QSGD(levels=2, seed=4), tfs.TopK(k=2)], ids=repr)
def test_the_delayed_update_is_the_compressed_gradient_of_step_t_minus_tau(compressor):
    tau, steps = 2, 6
    grads = _grads(steps, seed=1)
    deltas, opt = _run(DelayedGradients(tau), grads, compressor)
    residual = [tf.zeros(DIM) for _ in range(P)]
    sent = []
    for t in range(steps):
        row = []
        for p in range(P):
            g = tf.constant(grads[t, p])
            if compressor.unbiased:
                payload, ctx = compressor.compress(g, t, 0, p)
            else:
                payload, ctx, residual[p] = compressor.compress_with_feedback(
                    g, residual[p], t, 0, p
                )
            row.append(compressor.decompress(payload, ctx).numpy())
        sent.append(np.mean(row, axis=0))
    for t in range(steps):
        expected = sent[t - tau] if t >= tau else np.zeros(DIM)
        np.testing.assert_allclose(deltas[t], expected, atol=1e-6, err_msg=f"step {t}")
    assert np.abs(deltas[tau:] - grads[:-tau].mean(axis=1)).max() > 1e-3  # compression acted
    if not compressor.unbiased:
        np.testing.assert_allclose(opt.residuals[0].numpy(), np.stack(residual), atol=1e-6)


def test_random_delays_are_seeded_bounded_and_applied_as_drawn():
    server = DelayedGradients(3, model="random", seed=7)
    steps = 30
    delays = np.array([server.delays(t, P).numpy() for t in range(steps)])
    again = np.array([DelayedGradients(3, "random", 7).delays(t, P).numpy() for t in range(steps)])
    other = np.array([DelayedGradients(3, "random", 8).delays(t, P).numpy() for t in range(steps)])
    np.testing.assert_array_equal(delays, again)
    assert not np.array_equal(delays, other)
    assert set(np.unique(delays)) == {0, 1, 2, 3}
    assert any(len(set(row)) > 1 for row in delays)  # drawn per worker, not per step only
    grads = _grads(steps, seed=2)
    deltas, _ = _run(server, grads)
    np.testing.assert_allclose(deltas, _delayed_mean(grads, delays), atol=1e-6)


def test_per_replica_delays_model_stragglers():
    grads = _grads(8, seed=3)
    deltas, opt = _run(DelayedGradients([0, 2, 1], model="per_replica"), grads)
    delays = np.tile([0, 2, 1], (8, 1))
    np.testing.assert_allclose(deltas, _delayed_mean(grads, delays), atol=1e-6)
    assert opt.tables[0].shape == (3, P, DIM)  # ring buffer of max delay + 1 steps


def test_simulated_workers_fit_equals_delayed_gradient_descent_by_hand():
    """``fit`` on 3 simulated workers (batches of 8 cut 2/3/3) with tau = 2, least squares."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(24, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1)) + 0.1).astype("float32")
    lr, tau, batch, epochs = 0.05, 2, 8, 2
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    w0, b0 = (v.numpy().astype("float64") for v in model.weights)
    wrapper = SimulatedWorkers(model)
    opt = ServerOptimizer(
        keras.optimizers.SGD(lr), tfs.Identity(), DelayedGradients(tau), workers=P
    )
    wrapper.compile(optimizer=opt, loss="mse")
    history = wrapper.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)

    iterates = [(w0, b0)]
    grads = []
    for t in range(epochs * len(x) // batch):
        xb = x[(t * batch) % len(x) :][:batch].astype("float64")
        yb = y[(t * batch) % len(x) :][:batch].astype("float64")
        w, b = iterates[-1]
        g_w, g_b = np.zeros_like(w), np.zeros_like(b)
        for p in range(P):
            lo, hi = p * batch // P, (p + 1) * batch // P
            r = xb[lo:hi] @ w + b - yb[lo:hi]
            g_w += 2 * xb[lo:hi].T @ r / (hi - lo) / P
            g_b += 2 * r.mean(axis=0) / P
        grads.append((g_w, g_b))
        if t >= tau:
            w, b = w - lr * grads[t - tau][0], b - lr * grads[t - tau][1]
        iterates.append((w, b))
    np.testing.assert_allclose(model.weights[0].numpy(), iterates[-1][0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.weights[1].numpy(), iterates[-1][1], rtol=1e-5, atol=1e-6)
    assert np.abs(iterates[-1][0] - w0).max() > 1e-2
    assert np.isfinite(history.history["loss"]).all()


def _regression_data():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(32, 6)).astype("float32")
    return x, (x @ rng.normal(size=(6, 2))).astype("float32")


def _mlp():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]
    )


@pytest.mark.parametrize(
    "server", [DelayedGradients(0), DelayedGradients(2), IAG()], ids=["tau0", "tau2", "iag"]
)
def test_mirrored_strategy_equals_simulated_workers(mirrored2, server):
    """Two replicas of MirroredStrategy == two workers simulated on one device (same split)."""
    x, y = _regression_data()
    compressor = tfs.QSGD(levels=4, seed=3)  # replica-keyed noise: the keys must match too
    with mirrored2.scope():
        mirrored = _mlp()
        mirrored.compile(
            optimizer=ServerOptimizer(keras.optimizers.SGD(0.1), compressor, server), loss="mse"
        )
    mirrored.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    simulated = _mlp()
    wrapper = SimulatedWorkers(simulated)
    wrapper.compile(
        optimizer=ServerOptimizer(keras.optimizers.SGD(0.1), compressor, server, workers=2),
        loss="mse",
    )
    wrapper.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    start = _mlp()
    for a, b, s in zip(mirrored.weights, simulated.weights, start.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
        assert np.abs(a.numpy() - s.numpy()).max() > 1e-3
    tables = mirrored.optimizer.tables
    assert tables[0].shape == (*server.table_dims(2), 6, 8)
    if isinstance(server, DelayedGradients) and server.max_delay == 0:
        with mirrored2.scope():
            plain = _mlp()
            plain.compile(
                optimizer=tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), compressor),
                loss="mse",
            )
        plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(mirrored.weights, plain.weights, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


def _single_step(opt, w, a, b):
    @tf.function
    def step():
        grad = tf.linalg.matvec(a, tf.linalg.matvec(a, w.value) - b, adjoint_a=True)
        opt.apply([grad], [w])

    return step


def test_tau_zero_equals_no_delay_with_error_feedback():
    """One device: ServerOptimizer(DelayedGradients(0)) == SparsifiedOptimizer, step by step."""
    rng = np.random.default_rng(4)
    a = tf.constant(rng.normal(size=(6, DIM)).astype("float32"))
    b = tf.constant(rng.normal(size=6).astype("float32"))
    runs = []
    for make in (
        lambda: ServerOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), DelayedGradients(0)),
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2)),
    ):
        w = keras.Variable(np.ones(DIM, "float32"))
        opt = make()
        opt.build([w])
        step = _single_step(opt, w, a, b)
        trace = []
        for _ in range(6):
            step()
            trace.append((w.numpy(), opt.residuals[0].numpy()))
        runs.append(trace)
    for (w1, r1), (w2, r2) in zip(*runs, strict=True):
        np.testing.assert_allclose(w1, w2, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(r1, r2, rtol=1e-6, atol=1e-7)
    assert np.abs(runs[0][-1][1]).max() > 1e-3  # error feedback was at work


def test_simulated_tau_zero_is_synchronous_compressed_sgd_by_hand():
    grads = _grads(6, seed=4)
    delayed, _ = _run(DelayedGradients(0), grads, tfs.TopK(k=2))
    compressor = tfs.TopK(k=2)
    residual = [tf.zeros(DIM) for _ in range(P)]
    for t, g in enumerate(grads):
        total = 0.0
        for p in range(P):
            payload, ctx, residual[p] = compressor.compress_with_feedback(
                tf.constant(g[p]), residual[p], t, 0, p
            )
            total += compressor.decompress(payload, ctx).numpy() / P
        np.testing.assert_allclose(delayed[t], total, atol=1e-6)


def _least_squares_step(opt, w, a, b):
    @tf.function
    def step():
        r = tf.einsum("pij,j->pi", a, w) - b
        opt.apply([tf.einsum("pij,pi->pj", a, r)], [w])

    return step


@pytest.mark.parametrize(
    "server",
    [DelayedGradients(3, model="random", seed=2), IAG("random", num_refresh=2, seed=5)],
    ids=["random_delays", "iag_random"],
)
def test_checkpoint_restore_then_continue_equals_not_stopping(tmp_path, server):
    rng = np.random.default_rng(7)
    a = tf.constant(rng.normal(size=(P, 4, DIM)).astype("float32") / 3)
    b = tf.constant(rng.normal(size=(P, 4)).astype("float32"))

    def fresh():
        w = keras.Variable(np.ones(DIM, "float32"))
        opt = ServerOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), server, workers=P)
        opt.build([w])
        return w, opt, _least_squares_step(opt, w, a, b)

    w, opt, step = fresh()
    for _ in range(10):
        step()
    w1, opt1, step1 = fresh()
    for _ in range(6):
        step1()
    path = tf.train.Checkpoint(w=w1, optimizer=opt1).save(str(tmp_path / "ckpt"))
    w2, opt2, step2 = fresh()
    tf.train.Checkpoint(w=w2, optimizer=opt2).restore(path).assert_consumed()
    np.testing.assert_array_equal(opt2.tables[0].numpy(), opt1.tables[0].numpy())
    for _ in range(4):
        step2()
    np.testing.assert_allclose(w2.numpy(), w.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(opt2.residuals[0].numpy(), opt.residuals[0].numpy(), atol=1e-7)
    assert int(opt2.iterations.numpy()) == 10
    assert np.abs(opt.tables[0].numpy()).max() > 0


def test_keras_file_roundtrip_keeps_tables_and_continues(tmp_path):
    x, y = _regression_data()
    model = _mlp()
    model.compile(
        optimizer=ServerOptimizer(
            keras.optimizers.SGD(0.1), tfs.TopK(k=3), DelayedGradients(2, "random", seed=1)
        ),
        loss="mse",
    )
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, ServerOptimizer)
    assert loaded.optimizer.server.get_config() == {"delay": 2, "model": "random", "seed": 1}
    for a, b in zip(model.optimizer.tables, loaded.optimizer.tables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert np.abs(model.optimizer.tables[0].numpy()).max() > 0
    model.train_on_batch(x[:8], y[:8])
    loaded.train_on_batch(x[:8], y[:8])
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_non_finite_step_enters_no_table_and_is_handed_on():
    grads = _grads(3, seed=8)
    grads[1, 2, 0] = np.nan
    deltas, opt = _run(DelayedGradients(1), grads)
    assert np.isnan(deltas[1]).all()  # the inner optimizer sees the bad step
    np.testing.assert_array_equal(opt.tables[0].numpy()[1], 0.0)  # step 1 contributes nothing
    np.testing.assert_allclose(opt.tables[0].numpy()[0], grads[2] / P, atol=1e-7)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DelayedGradients(-1), "delay.*-1"),
        (lambda: DelayedGradients(2.0), "delay.*2.0"),
        (lambda: DelayedGradients(1.5), "delay.*1.5"),
        (lambda: DelayedGradients(True), "delay.*True"),
        (lambda: DelayedGradients(2, model="poisson"), "model.*poisson"),
        (lambda: DelayedGradients([1, 2]), "delay.*\\[1, 2\\]"),
        (lambda: DelayedGradients(2, model="per_replica"), "delay.*2"),
        (lambda: DelayedGradients([1, -2], model="per_replica"), "delay.*-2"),
        (lambda: DelayedGradients(2, seed=-1), "seed"),
        (lambda: ServerOptimizer(keras.optimizers.SGD(), tfs.TopK(k=1), None), "server.*None"),
        (
            lambda: ServerOptimizer(keras.optimizers.SGD(), tfs.TopK(k=1), IAG(), workers=0),
            "workers.*0",
        ),
        (
            lambda: ServerOptimizer(
                keras.optimizers.SGD(), tfs.TopK(k=1), IAG(), workers=2, local_clipnorm=1.0
            ),
            "local_clipnorm",
        ),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_worker_counts_and_gradient_shapes_raise_value_error(mirrored2):
    w = keras.Variable(np.zeros(DIM, "float32"))
    opt = ServerOptimizer(
        keras.optimizers.SGD(), tfs.Identity(), DelayedGradients([0, 1], "per_replica"), workers=3
    )
    with pytest.raises(ValueError, match="one entry per worker"):
        opt.build([w])
    opt = ServerOptimizer(keras.optimizers.SGD(), tfs.Identity(), DelayedGradients(1), workers=3)
    with pytest.raises(ValueError, match="stacked per worker"):
        opt.apply([tf.zeros(DIM)], [w])
    with mirrored2.scope():
        v = keras.Variable(np.zeros(DIM, "float32"))
        opt = ServerOptimizer(keras.optimizers.SGD(), tfs.Identity(), IAG(), workers=2)
        with pytest.raises(ValueError, match="workers=None"):
            opt.build([v])


def test_simulated_workers_need_a_server_optimizer_with_workers():
    x, y = _regression_data()
    wrapper = SimulatedWorkers(_mlp())
    wrapper.compile(
        optimizer=ServerOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), DelayedGradients(1)),
        loss="mse",
    )
    with pytest.raises(ValueError, match="workers=P"):
        wrapper.fit(x, y, batch_size=8, epochs=1, verbose=0)
