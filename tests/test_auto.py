"""Automatic compression: ``Auto`` (a setting per unit), its tuner and the Keras callback."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.compressors import deserialize, serialize
from tf_sparsify.core.auto_tuner import NO_LINK, AutoTuner
from tf_sparsify.step_model.choice import auto_settings, compute_for, predicted_step
from tf_sparsify.step_model.link_fit import LinkMeasurement
from tf_sparsify.step_model.shapes import Layers
from tf_sparsify.testing import numpy_reference

SHAPES = [(40, 50), (50,), (50, 30), (30, 20), (20, 10)]
#: 1 Gbit/s-like: 4 KiB in 0.2 ms, 4 MiB in 70 ms
SLOW = LinkMeasurement(2, (2**12, 2**22), (2e-4, 7e-2))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"densities": ()}, "densities"),
        ({"densities": (0.01, 0.01)}, "densities"),
        ({"densities": (0.0,)}, "ratio"),
        ({"densities": "0.01"}, "densities"),
        ({"half": "fp8"}, "half"),
        ({"levels": (0, 4)}, "levels[1]"),
        ({"levels": (-1,)}, "levels[0]"),
        ({"levels": (0.5,)}, "levels[0]"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, named):
    with pytest.raises(ValueError, match=re.escape(f"`{named}`")):
        tfs.Auto(**kwargs)


def test_settings_go_from_the_least_compression_to_the_most_and_survive_a_config():
    auto = tfs.Auto(densities=(0.001, 0.05), half="bf16", levels=(3, 0, 1))
    assert auto.names == ("dense", "bf16", "topk5%", "topk0.1%")
    assert auto.settings == (
        tfs.Identity(),
        tfs.BF16(),
        tfs.TopK(ratio=0.05),
        tfs.TopK(ratio=0.001),
    )
    assert deserialize(serialize(auto)) == auto
    assert auto.with_levels(None) == tfs.Auto(densities=(0.05, 0.001), half="bf16")


def test_each_compressed_unit_gets_its_level_and_small_ones_stay_dense():
    pipeline = tfs.GradientPipeline(tfs.Auto(levels=(3, 1, 2, 0)), skip_1d=True)
    units = pipeline.plan([tf.TensorShape(s) for s in SHAPES], [tf.float32] * len(SHAPES))
    sent = {u.indices: (u.position, u.compressor, u.error_feedback) for u in units}
    assert sent == {
        (0,): (0, tfs.TopK(ratio=0.001), True),
        (1,): (None, tfs.Identity(), False),
        (2,): (1, tfs.FP16(), True),
        (3,): (2, tfs.TopK(ratio=0.01), True),
        (4,): (3, tfs.Identity(), True),
    }
    alone = [tfs.TopK(ratio=0.001).wire_bytes(2000), 200, 3000, tfs.TopK(0.01).wire_bytes(600)]
    assert [u.wire_bytes for u in units] == [*alone, 800]
    with pytest.raises(ValueError, match=r"`levels` must hold one level per compressed unit \(4\)"):
        tfs.GradientPipeline(tfs.Auto(levels=(1, 1)), skip_1d=True).plan(
            [tf.TensorShape(s) for s in SHAPES], [tf.float32] * len(SHAPES)
        )


def test_changing_levels_keeps_each_residual_and_conserves_exactly():
    """Between steps the levels change (as the tuner changes them): each variable keeps its
    residual; dense and FP16 send it whole (integers: FP16 exact), TopK keeps what it does not
    select (the NumPy model). Update plus residual is the gradient plus the residual before."""
    rng = np.random.default_rng(5)
    variables = [
        keras.Variable(np.zeros(200, np.float32)),
        keras.Variable(np.zeros(300, np.float32)),
    ]
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(1.0), tfs.Auto(levels=(2, 3)))
    optimizer.build(variables)
    residuals = [np.zeros(200, np.float32), np.zeros(300, np.float32)]
    for levels in [(2, 3), (0, 2), (3, 1), (1, 0), (2, 2)]:
        auto = tfs.Auto(levels=levels)
        optimizer.set_compressor(auto)
        grads = [rng.integers(-64, 65, v.shape[0]).astype(np.float32) for v in variables]
        before = [v.numpy() for v in variables]
        step = tf.function(lambda g0, g1: optimizer.apply([g0, g1], variables))
        step(*(tf.constant(g) for g in grads))
        for i, (grad, level) in enumerate(zip(grads, levels, strict=True)):
            total = grad + residuals[i]
            sent = total.copy()
            codec = auto.settings[level]
            if isinstance(codec, tfs.TopK):
                keys = numpy_reference.magnitude_keys(total.view(np.uint32), "float32")
                kept = numpy_reference.topk_select(keys, codec.num_selected(total.size))
                sent[np.setdiff1d(np.arange(total.size), kept)] = 0
            residuals[i] = total - sent
            np.testing.assert_array_equal(before[i] - variables[i].numpy(), sent)
            np.testing.assert_array_equal(optimizer.residuals[i].numpy(), residuals[i])


def _tuner(cluster, **kwargs) -> AutoTuner:
    shapes = [(1000, 1000), (1000, 100)]
    return AutoTuner(tfs.Auto(), shapes, cluster, [0.0, 1e-10, 2e-9, 2e-9], **kwargs)


def test_compute_for_inverts_the_predicted_step():
    auto = tfs.Auto()
    settings = auto_settings(auto, [0.0, 1e-10, 2e-9, 2e-9])
    units = Layers(((1000, 1000), (1000, 100)))
    for levels, measured in [((0, 0), 0.2), ((2, 1), 0.1), ((3, 3), 0.5)]:
        compute = compute_for(measured, levels, units, settings, SLOW.cluster())
        step = predicted_step(levels, units, settings, SLOW.cluster(), compute).step
        assert step == pytest.approx(measured, rel=1e-5)
    assert compute_for(1e-6, (0, 0), units, settings, SLOW.cluster()) == 0.0


def test_on_one_replica_everything_stays_dense():
    tuner = _tuner(NO_LINK)
    for step in (100, 200):
        decision = tuner.decide(step, 0.01, [1.0, 1.0])
        assert decision.settings == ("dense", "dense")
        assert decision.predicted == pytest.approx(0.01, rel=1e-4)


def test_a_slow_link_compresses_once_the_phase_is_calm_and_pins_hold():
    tuner = _tuner(SLOW.cluster(), pinned={1: 1})
    first = tuner.decide(100, 0.1, [1.0, 1.0])  # the start is critical: at most fp16
    assert first.critical == (True, True) and first.settings == ("fp16", "fp16")
    calm = tuner.decide(200, first.predicted, [1.1, 1.0])
    assert calm.critical == (False, False)
    assert calm.settings[0].startswith("topk") and calm.settings[1] == "fp16"
    assert calm.predicted < first.predicted
    jump = tuner.decide(300, calm.predicted, [3.0, 1.0])  # the norm tripled: critical again
    assert jump.critical == (True, False) and jump.settings == ("fp16", "fp16")
    again = _tuner(SLOW.cluster(), pinned={1: 1})
    assert [again.decide(*d) for d in [(100, 0.1, [1.0, 1.0])]][0] == first
    assert "fp16 x2" in first.summary()


#: about 1 MB/s and no cost per call: the tiny model's dense exchange (5 KB) cannot hide
CRAWL = LinkMeasurement(2, (2**12, 2**22), (4e-3, 4.0))


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu", name="hidden"),
            keras.layers.Dense(4, name="out"),
        ],
        name="net",
    )


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 20)).astype(np.float32)
    y = (x[:, :4] > 0).argmax(axis=1)
    return x, y


def test_fit_changes_the_settings_between_steps_and_logs_them():
    """A slow link (given): the first interval runs dense, then the units go to fp16
    (critical at the start), then to TopK (``eta`` high: no later phase is critical); the
    step is retraced at each change, training goes on, and the epoch logs say what was
    used. The pinned kernel stays at fp16."""
    model = _model()
    model.compile(
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.Auto()),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    callback = tfs.AutoCompression(
        interval=4, link=CRAWL, eta=10, pinned={"net/out/kernel": "fp16"}
    )
    x, y = _data()
    history = model.fit(x, y, batch_size=32, epochs=2, callbacks=[callback], verbose=0)
    names = [d.settings for d in callback.decisions]  # hidden/kernel, bias, out/kernel, bias
    assert len(names) == 8  # after steps 4, 8, ..., 32 (the first step measures)
    assert names[0][0] == "fp16"
    assert any(s[0].startswith("topk") for s in names[1:])
    assert all(s[2] == "fp16" for s in names)
    assert model.optimizer.compressor.levels == callback.decisions[-1].levels
    assert callback.link is CRAWL and not callback.links  # a link given is kept
    assert np.isfinite(history.history["loss"]).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    logs = {k: v[-1] for k, v in history.history.items()}
    assert sum(logs[f"auto_units_{n}"] for n in tfs.Auto().names) == 4
    assert logs["auto_predicted_step_ms"] > 0 and logs["auto_measured_step_ms"] > 0


def test_a_custom_loop_changes_the_settings_and_retraces_when_told():
    """``AutoSteps`` on a ``GradientExchange``: the same decisions as in ``fit`` (the slow
    link given, ``eta`` high), the loop retraces its step each time ``step_done`` says the
    settings changed, and training goes on."""
    model = _model()
    exchange = tfs.GradientExchange(tfs.Auto())
    auto = tfs.AutoSteps(interval=4, link=CRAWL, eta=10)
    assert auto.attach(exchange) and exchange.grad_sq_norms_every == 1
    sgd = keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        sgd.apply(exchange.updates(grads, model.trainable_variables), model.trainable_variables)
        return loss

    x, y = _data()
    step, traces, losses = tf.function(train_step), 1, []
    for i in range(0, 512, 32):
        losses.append(float(step(x[i : i + 32], y[i : i + 32])))
        if auto.step_done():
            step, traces = tf.function(train_step), traces + 1
    names = [d.settings for d in auto.decisions]
    assert len(names) == 4 and names[0][0] == "fp16"
    assert any(s[0].startswith("topk") for s in names[1:])
    assert exchange.compressor.levels == auto.decisions[-1].levels
    changes = sum(a.levels != b.levels for a, b in itertools.pairwise(auto.decisions))
    assert traces == 2 + changes  # the first trace, the change from dense, the others
    assert np.isfinite(losses).all() and np.mean(losses[-4:]) < np.mean(losses[:4])


def test_auto_steps_needs_an_auto_front_end_and_to_be_attached():
    with pytest.raises(ValueError, match="compressor is tf_sparsify.Auto"):
        tfs.AutoSteps().attach(tfs.GradientExchange(tfs.TopK(0.01)))
    with pytest.raises(ValueError, match="attach"):
        tfs.AutoSteps().step_done()


def test_under_mirrored_the_link_is_measured_and_it_stays_dense_on_one_machine(mirrored2):
    """The probe and the agreement run through the strategy's all-reduce (one strategy per
    process: a second one's collectives would reuse the first one's instance keys)."""
    with mirrored2.scope():
        model = _model()
        model.compile(
            tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.Auto()),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    callback = tfs.AutoCompression(interval=4, link_every=1)
    x, y = _data()
    model.fit(x, y, batch_size=64, epochs=1, callbacks=[callback], verbose=0)
    assert callback.link is not None and callback.link.workers == 2
    assert callback.decisions and callback.overhead > 0
    # measured after step 1, again before the decision after step 8 (not before the first)
    assert [step for step, _ in callback.links] == [1, 8]
    assert callback.link is callback.links[-1][1] and callback.link.cpu_seconds is not None


def test_the_callback_needs_an_auto_compressor():
    model = _model()
    model.compile(tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(0.01)), "mse")
    with pytest.raises(ValueError, match="compressor is tf_sparsify.Auto"):
        model.fit(*_data(), epochs=1, callbacks=[tfs.AutoCompression()], verbose=0)
    with pytest.raises(ValueError, match="`interval`"):
        tfs.AutoCompression(interval=1)
    with pytest.raises(ValueError, match="`link`"):
        tfs.AutoCompression(link="1gbit")
    with pytest.raises(ValueError, match="link_every"):
        tfs.AutoCompression(link_every=0)


def test_a_checkpoint_restores_the_decisions_with_the_residuals(tmp_path):
    """The levels are state: a fresh ``Auto()`` restores them (and the residuals) exactly; an
    ``Auto`` of other settings is another configuration and is refused by name."""
    rng = np.random.default_rng(2)
    variables = [keras.Variable(np.zeros((40, 50), np.float32))]
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.Auto(levels=(3,)))
    optimizer.build(variables)
    optimizer.apply([tf.constant(rng.normal(size=(40, 50)).astype(np.float32))], variables)
    path = tf.train.Checkpoint(optimizer=optimizer).write(str(tmp_path / "ckpt"))

    fresh = [keras.Variable(np.zeros((40, 50), np.float32))]
    restored = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.Auto())
    restored.build(fresh)
    tf.train.Checkpoint(optimizer=restored).read(path).assert_consumed()
    assert restored.compressor == tfs.Auto(levels=(3,))
    assert restored.units[0].compressor == tfs.TopK(ratio=0.001)
    np.testing.assert_array_equal(restored.residuals[0].numpy(), optimizer.residuals[0].numpy())

    other = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.Auto(densities=(0.05,)))
    other.build([keras.Variable(np.zeros((40, 50), np.float32))])
    with pytest.raises(ValueError, match="another configuration"):
        tf.train.Checkpoint(optimizer=other).read(path)


def _auto_fit(model: keras.Model, **options) -> tfs.AutoCompression:
    """An epoch of 8 steps (the data's first 256 rows, in order) under ``AutoCompression``."""
    callback = tfs.AutoCompression(interval=4, eta=10, **options)
    x, y = _data()
    model.fit(x[:256], y[:256], batch_size=32, shuffle=False, callbacks=[callback], verbose=0)
    return callback


def _compiled() -> keras.Model:
    model = _model()
    model.compile(
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.Auto()),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.optimizer.build(model.trainable_variables)
    return model


def test_a_resumed_fit_decides_when_and_as_the_one_that_did_not_stop(tmp_path):
    """The link, each unit's last gradient norms and the count of decisions travel in the
    checkpoint with the levels (``Auto.memory``, exactly): a job stopped after 8 steps and
    resumed by a callback given no link decides after steps 12 and 16 as the job that ran on
    does: on the slow link (not one replica's none), the units calm (not critical as at a
    start, which would cap them at fp16). Which TopK each unit gets also follows the step
    times measured, so the levels are not compared."""
    straight = _compiled()
    callback = _auto_fit(straight, link=CRAWL)
    want = callback.decisions + _auto_fit(straight, link=CRAWL).decisions

    stopped = _compiled()
    _auto_fit(stopped, link=CRAWL)
    memory = stopped.optimizer.compressor.memory
    assert memory["decided"] == 2 and len(memory["norms"]) == 4
    assert LinkMeasurement.from_dict(memory["link"]) == CRAWL
    path = tf.train.Checkpoint(model=stopped, optimizer=stopped.optimizer).write(
        str(tmp_path / "ckpt")
    )

    resumed = _compiled()
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).read(path).assert_consumed()
    assert resumed.optimizer.compressor == stopped.optimizer.compressor
    again = _auto_fit(resumed)
    assert again.link == CRAWL and not again.links  # restored, not measured
    got = [(d.step, d.critical) for d in again.decisions]
    assert (
        got == [(d.step, d.critical) for d in want[2:]] == [(12, (False,) * 4), (16, (False,) * 4)]
    )
    assert any(level > 1 for level in again.decisions[0].levels)  # TopK: past the cap
    assert resumed.optimizer.compressor.memory["decided"] == 4


@pytest.mark.parametrize(
    "memory, named",
    [
        ({"norm": [1.0]}, "`memory`"),
        ({"norms": [1.0, float("nan")]}, "norms"),
        ({"norms": [-1.0]}, "norms"),
        ({"link": {"workers": 2}}, "link"),
        ({"decided": -1}, "decided"),
        ([1.0], "`memory`"),
    ],
)
def test_a_bad_memory_is_named(memory, named):
    with pytest.raises(ValueError, match=re.escape(named)):
        tfs.Auto(memory=memory)


def test_the_memory_is_a_decision_that_survives_a_config():
    memory = {"norms": [1.5, 2.0], "link": dataclasses.asdict(SLOW), "decided": 3}
    auto = tfs.Auto(levels=(0, 2), memory=memory)
    assert deserialize(serialize(auto)) == auto
    assert deserialize(json.loads(json.dumps(serialize(auto)))) == auto
    assert auto.with_levels((1, 1)).memory == auto.memory
    assert auto.without_decisions() == tfs.Auto()
    tuner = AutoTuner(auto, SHAPES[:2], SLOW.cluster(), [1e-9] * len(auto.settings))
    assert tuner.previous_norms == [1.5, 2.0]
    with pytest.raises(ValueError, match="one norm per compressed unit"):
        AutoTuner(auto, SHAPES, SLOW.cluster(), [1e-9] * len(auto.settings))
