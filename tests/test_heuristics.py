"""DGC heuristics: momentum correction, local clipping, skipping 1-D tensors, density warm-up."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives import LocalCollective, ReplicaContextCollective
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.step import StepMemory
from tf_sparsify.heuristics import (
    DensitySchedule,
    clip_by_local_norm,
    dgc_density_schedule,
    local_clip_threshold,
    with_density,
)


def topk_indices(v: np.ndarray, k: int) -> np.ndarray:
    """Largest |v| first, ties to the lowest index (stable sort of -|v|)."""
    return np.sort(np.argsort(-np.abs(v.ravel()), kind="stable")[:k])


def dgc_reference(grads: list[np.ndarray], k: int, m: float):
    """Hand-written DGC on one replica: momentum correction and momentum factor masking."""
    u = np.zeros_like(grads[0])
    v = np.zeros_like(grads[0])
    out = []
    for g in grads:
        u = m * u + g
        v = v + u
        idx = topk_indices(v, k)
        sent = np.zeros(v.size)
        sent[idx] = v.ravel()[idx]
        sent = sent.reshape(v.shape)
        mask = np.zeros(v.size, bool)
        mask[idx] = True
        mask = mask.reshape(v.shape)
        v = np.where(mask, 0.0, v)
        u = np.where(mask, 0.0, u)
        out.append((sent, v.copy(), u.copy()))
    return out


# -- momentum correction ---------------------------------------------------------------------


def test_momentum_correction_matches_hand_written_dgc():
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal((6, 5)) for _ in range(12)]
    pipe = GradientPipeline(tfs.TopK(k=4), momentum_correction=0.9)
    units = pipe.plan([(6, 5)], [tf.float64])
    residual = tf.zeros((6, 5), tf.float64)
    buffer = tf.zeros((6, 5), tf.float64)
    for t, (g, (sent, v, u)) in enumerate(zip(grads, dgc_reference(grads, 4, 0.9), strict=True)):
        res = pipe.run(
            units,
            [tf.constant(g)],
            StepMemory([residual], tf.constant(t, tf.int64), momenta=[buffer]),
            LocalCollective(),
        )
        residual, buffer = res.residuals[0], res.momenta[0]
        np.testing.assert_allclose(res.updates[0].numpy(), sent, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(residual.numpy(), v, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(buffer.numpy(), u, rtol=1e-12, atol=1e-12)


def test_momentum_correction_in_keras_matches_reference():
    """SGD(lr) applies lr * (TopK of the momentum-corrected accumulator), step for step."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4)).astype("float32")
    y = rng.standard_normal((8, 3)).astype("float32")
    w0 = rng.standard_normal((4, 3)).astype("float32")
    lr, m, k, steps = 0.1, 0.8, 3, 8

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, use_bias=False)])
    model.layers[0].set_weights([w0])
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(lr), tfs.TopK(k=k), momentum_correction=m)
    model.compile(opt, "mse")
    model.fit(x, y, batch_size=8, epochs=steps, shuffle=False, verbose=0)

    w = w0.astype(np.float64)
    u = np.zeros_like(w)
    v = np.zeros_like(w)
    xd, yd = x.astype(np.float64), y.astype(np.float64)
    for _ in range(steps):
        g = 2.0 / yd.size * xd.T @ (xd @ w - yd)
        u = m * u + g
        v = v + u
        idx = topk_indices(v, k)
        sent = np.zeros(v.size)
        sent[idx] = v.ravel()[idx]
        mask = np.isin(np.arange(v.size), idx).reshape(v.shape)
        v, u = np.where(mask, 0.0, v), np.where(mask, 0.0, u)
        w = w - lr * sent.reshape(w.shape)
    np.testing.assert_allclose(model.layers[0].get_weights()[0], w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(opt.residuals[0].numpy(), v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(opt.momenta[0].numpy(), u, rtol=1e-4, atol=1e-5)


def _train(optimizer, steps=6, seed=2):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 5)).astype("float32")
    y = rng.standard_normal((16, 2)).astype("float32")
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=16, epochs=steps, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def test_momentum_correction_on_uncompressed_tensors_is_momentum_sgd():
    """Tensors below min_size travel dense: u = m*u + g unmasked, i.e. SGD with momentum."""
    ours = _train(
        tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.05), tfs.TopK(k=1), min_size=10**6, momentum_correction=0.9
        )
    )
    ref = _train(keras.optimizers.SGD(0.05, momentum=0.9))
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_momentum_correction_at_full_density_is_plain_sgd():
    """Masking resets u wherever it was sent: at density 1 DGC degenerates to plain SGD."""
    ours = _train(
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(1.0), momentum_correction=0.9)
    )
    ref = _train(keras.optimizers.SGD(0.05))
    momentum = _train(keras.optimizers.SGD(0.05, momentum=0.9))
    for a, b in zip(ours, ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ours[0], momentum[0], atol=1e-4)


def test_momentum_correction_validates_inner_optimizer_and_factor():
    with pytest.raises(ValueError, match="momentum=0"):
        tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), tfs.TopK(0.1), momentum_correction=0.9
        )
    with pytest.warns(UserWarning, match="plain SGD"):
        tfs.SparsifiedOptimizer(keras.optimizers.Adam(), tfs.TopK(0.1), momentum_correction=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.1), momentum_correction=0.9)
    for bad in (1.0, -0.1, True, "0.9", float("nan")):
        with pytest.raises(ValueError, match="momentum_correction"):
            GradientPipeline(tfs.TopK(0.1), momentum_correction=bad)
    pipe = GradientPipeline(tfs.TopK(0.1), momentum_correction=0.5)
    units = pipe.plan([(4,)], [tf.float32])
    with pytest.raises(ValueError, match="momenta"):
        pipe.run(units, [tf.ones(4)], StepMemory([tf.zeros(4)], tf.constant(0)), LocalCollective())


def test_sent_mask_marks_topk_and_randomk_entries_and_defaults_to_nonzero():
    x = tf.constant([0.0, -5.0, 1.0, 0.0, 3.0])
    topk = tfs.TopK(k=3)
    payload, ctx = topk.compress(x)
    np.testing.assert_array_equal(topk.sent_mask(payload, ctx).numpy(), [0, 1, 1, 0, 1])
    # an entry selected with value 0 still counts as sent
    zeros = tf.zeros(4)
    payload, ctx = topk.compress(zeros)
    np.testing.assert_array_equal(topk.sent_mask(payload, ctx).numpy(), [1, 1, 1, 0])
    randk = tfs.RandomK(0.4, seed=3)
    payload, ctx = randk.compress(x, step=7, tensor_id=2)
    expected = np.zeros(5)
    expected[randk.indices(5, 7, 2).numpy()] = 1
    np.testing.assert_array_equal(randk.sent_mask(payload, ctx).numpy(), expected)
    assert expected.sum() == 2
    sign = tfs.ScaledSign()  # the default: where the decompressed payload is non-zero
    payload, ctx = sign.compress(tf.constant([0.0, -2.0, 1.0]))
    np.testing.assert_array_equal(sign.sent_mask(payload, ctx).numpy(), [1, 1, 1])


def test_momentum_buffers_are_optimizer_state_and_config_round_trips():
    opt = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1),
        tfs.TopK(0.5),
        momentum_correction=0.9,
        local_clipnorm=2.0,
        skip_1d=True,
    )
    _train(opt, steps=2)
    names = [v.path for v in opt.variables]
    assert sum("momentum" in n for n in names) == 2  # kernel and bias
    assert sum("residual" in n for n in names) == 1  # the bias is 1-D: skipped
    config = opt.get_config()
    assert config["momentum_correction"] == 0.9
    assert config["local_clipnorm"] == 2.0
    assert config["skip_1d"] is True
    again = tfs.SparsifiedOptimizer.from_config(config)
    assert again.pipeline.get_config() == opt.pipeline.get_config()
    plain = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.5)).get_config()
    assert not {"momentum_correction", "local_clipnorm", "skip_1d"} & set(plain)


# -- local clipping ----------------------------------------------------------------------------


def test_clip_by_local_norm_known_values():
    a, b = tf.constant([3.0, 0.0]), tf.constant([[0.0], [4.0]])
    clipped = clip_by_local_norm([a, None, b], 1.0)
    assert clipped[1] is None
    np.testing.assert_allclose(clipped[0].numpy(), [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(clipped[2].numpy(), [[0.0], [0.8]], rtol=1e-6)
    kept = clip_by_local_norm([a, b], 10.0)
    np.testing.assert_array_equal(kept[0].numpy(), a.numpy())
    zero = clip_by_local_norm([tf.zeros(3)], 1.0)
    np.testing.assert_array_equal(zero[0].numpy(), np.zeros(3))
    bad = clip_by_local_norm([tf.constant([1.0, np.inf]), tf.constant([1.0])], 1.0)
    assert np.isnan(bad[1].numpy()).all()
    assert local_clip_threshold(2.0, num_replicas=4) == pytest.approx(1.0)
    assert local_clip_threshold(2.0, num_replicas=4, divisor=4) == pytest.approx(4.0)


def test_local_clipping_happens_before_accumulation():
    """Residual plus update equals the clipped gradient: nothing unclipped is remembered."""
    pipe = GradientPipeline(tfs.TopK(k=1), local_clipnorm=1.0)
    units = pipe.plan([(2,), (2,)], [tf.float64, tf.float64])
    grads = [tf.constant([30.0, 0.0], tf.float64), tf.constant([0.0, 40.0], tf.float64)]
    res = pipe.run(units, grads, StepMemory([tf.zeros(2, tf.float64)] * 2, 0), LocalCollective())
    total = [u.numpy() + r.numpy() for u, r in zip(res.updates, res.residuals, strict=True)]
    np.testing.assert_allclose(total[0], [0.6, 0.0], rtol=1e-12)
    np.testing.assert_allclose(total[1], [0.0, 0.8], rtol=1e-12)
    with pytest.raises(ValueError, match="local_clipnorm"):
        GradientPipeline(tfs.TopK(k=1), local_clipnorm=0.0)


def test_local_clipping_scales_with_replicas(mirrored2):
    """Two replicas: each replica's gradient is clipped to clipnorm / sqrt(2)."""
    pipe = GradientPipeline(tfs.Identity(), local_clipnorm=1.0)
    units = pipe.plan([(2,)], [tf.float32])

    def replica_fn():
        ctx = tf.distribute.get_replica_context()
        scale = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)
        g = tf.constant([3.0, 4.0]) * scale
        res = pipe.run(
            units, [g], StepMemory([None], tf.constant(0)), ReplicaContextCollective(ctx)
        )
        return res.updates[0]

    out = mirrored2.run(tf.function(replica_fn))
    update = mirrored2.experimental_local_results(out)[0].numpy()
    np.testing.assert_allclose(update, 2 * np.array([0.6, 0.8]) / np.sqrt(2), rtol=1e-5)


# -- skipping 1-D tensors -----------------------------------------------------------------------


def test_skip_1d_plans_small_rank_tensors_dense():
    pipe = GradientPipeline(tfs.TopK(0.5), skip_1d=True)
    shapes = [(3,), (4, 4), (), (2, 2, 2)]
    units = pipe.plan(shapes, [tf.float32] * 4)
    kinds = {u.indices: type(u.compressor).__name__ for u in units}
    assert kinds == {(0,): "Identity", (1,): "TopK", (2,): "Identity", (3,): "TopK"}
    assert pipe.needs_residual(units, 4) == [False, True, False, True]
    glob = GradientPipeline(tfs.TopK(0.5), skip_1d=True, scope="global").plan(
        shapes, [tf.float32] * 4
    )
    assert [u.indices for u in glob if isinstance(u.compressor, tfs.TopK)] == [(1, 3)]
    default = GradientPipeline(tfs.TopK(0.5)).plan(shapes, [tf.float32] * 4)
    assert all(isinstance(u.compressor, tfs.TopK) for u in default)
    with pytest.raises(ValueError, match="skip_1d"):
        GradientPipeline(tfs.TopK(0.5), skip_1d=1)


def test_skip_1d_in_keras_counts_dense_bias_bytes():
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), skip_1d=True)
    _train(opt, steps=1)
    # kernel 5x2: k=2 float32 values + a 1-byte index code; bias (2,) dense float32
    assert opt.wire_bytes_per_step == 2 * 4 + 1 + 2 * 4
    assert [r is None for r in opt.residuals] == [False, True]


# -- density warm-up -----------------------------------------------------------------------------


def test_dgc_schedule_values():
    s = dgc_density_schedule(0.001)
    assert [s(e) for e in range(7)] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001, 0.001]
    assert s.warmup_epochs == 4
    clamped = dgc_density_schedule(0.1, warmup_epochs=3)
    assert [clamped(e) for e in range(4)] == [0.25, 0.1, 0.1, 0.1]
    custom = dgc_density_schedule(0.01, warmup_epochs=2, start=0.5, factor=0.1)
    assert [custom(e) for e in range(3)] == [0.5, pytest.approx(0.05), 0.01]
    assert dgc_density_schedule(0.2, warmup_epochs=0)(0) == 0.2
    assert DensitySchedule(0.1, [0.5]) == DensitySchedule(0.1, [0.5])
    for kwargs in ({"target": 0.0}, {"target": 0.1, "factor": 0.0}, {"target": 0.1, "start": 2}):
        with pytest.raises(ValueError):
            dgc_density_schedule(**kwargs)
    with pytest.raises(ValueError, match="epoch"):
        s(-1)


def test_with_density_replaces_ratio():
    assert with_density(tfs.TopK(k=5), 0.1) == tfs.TopK(ratio=0.1)
    assert with_density(tfs.RandomK(0.5, seed=4), 0.25) == tfs.RandomK(0.25, seed=4)
    with pytest.raises(ValueError, match="ratio"):
        with_density(tfs.QSGD(4), 0.1)


def test_density_warmup_changes_what_is_sent_and_counted():
    """Bytes per step and the density actually sent follow the schedule, epoch by epoch."""
    schedule = DensitySchedule(0.02, [0.5, 0.25, 0.1])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 20)).astype("float32")
    y = rng.integers(0, 4, 64)
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((20,)), keras.layers.Dense(30, activation="relu"), keras.layers.Dense(4)]
    )
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.02), skip_1d=True)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    warm = tfs.DensityWarmup(schedule)
    diag = tfs.CompressionDiagnostics(every_n_steps=1)
    hist = model.fit(
        x,
        y,
        batch_size=16,
        epochs=5,
        verbose=0,
        callbacks=[warm, tfs.CompressionStats(), diag],
    ).history

    densities = [schedule(e) for e in range(5)]
    assert warm.densities == densities
    assert hist["scheduled_density"] == densities
    shapes = [(20, 30), (30,), (30, 4), (4,)]
    for epoch, d in enumerate(densities):
        topk = tfs.TopK(d)
        wire = topk.wire_bytes(600) + 30 * 4 + topk.wire_bytes(120) + 4 * 4
        assert hist["bytes_per_step"][epoch] == wire
        k = topk.num_selected(600) + topk.num_selected(120)
        sent = k + 34  # biases travel dense, all entries non-zero
        assert hist["density"][epoch] == pytest.approx(sent / sum(np.prod(s) for s in shapes))
        assert hist["wire_density"][epoch] == pytest.approx(hist["density"][epoch])
    # every step of an epoch was measured with that epoch's compressor
    per_epoch = {}
    for r in diag.records:
        per_epoch.setdefault(r["epoch"], set()).add(round(r["density"], 9))
    assert all(len(v) == 1 for v in per_epoch.values()) and len(per_epoch) == 5
    assert opt.compressor == tfs.TopK(0.02)
    assert int(opt.bytes_sent.numpy()) == sum(4 * b for b in hist["bytes_per_step"])


def test_keras_file_keeps_momenta_and_options_and_continues(tmp_path):
    """A .keras round trip carries the momentum buffers and every heuristic option."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )
    opt = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1),
        tfs.TopK(0.25),
        momentum_correction=0.8,
        local_clipnorm=1.0,
        skip_1d=True,
        diagnostics_every=2,
    )
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    lopt = loaded.optimizer
    assert lopt.pipeline.get_config() == opt.pipeline.get_config()
    assert lopt.diagnostics_every == 2
    for a, b in zip(opt.momenta, lopt.momenta, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert np.abs(a.numpy()).sum() > 0
            np.testing.assert_array_equal(a.numpy(), b.numpy())
    model.train_on_batch(x[:8], y[:8])
    loaded.train_on_batch(x[:8], y[:8])
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
