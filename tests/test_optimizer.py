"""SparsifiedOptimizer contracts: identity equivalence, averaging without a dense all-reduce,
checkpoint and .keras continuation, Keras options, mixed precision, bad input."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tests.conftest import run_python
from tests.embedding_model import embedding_model
from tf_sparsify.testing import numpy_reference

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 8)).astype("float32")
Y = rng.integers(0, 3, size=64)


def make_model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )


def compile_fit(optimizer, epochs=2, strategy=None, batch_size=16):
    scope = strategy.scope() if strategy else tf.distribute.get_strategy().scope()
    with scope:
        model = make_model()
        opt = optimizer()
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, epochs=epochs, batch_size=batch_size, shuffle=False, verbose=0)
    return model, opt


INNERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("distributed", [False, True], ids=["single", "mirrored2"])
def test_identity_equals_plain_inner_optimizer(inner, distributed, request):
    strategy = request.getfixturevalue("mirrored2") if distributed else None
    plain, _ = compile_fit(INNERS[inner], strategy=strategy)
    wrapped, _ = compile_fit(
        lambda: tfs.SparsifiedOptimizer(INNERS[inner](), tfs.Identity()), strategy=strategy
    )
    for a, b in zip(plain.weights, wrapped.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_fit_traces_its_step_once_and_reads_no_batch_to_build():
    """Without a strategy the optimizer (and the metrics) are built before the first trace of
    the train step, from the input's shapes: one trace, where variables made inside it would
    cost Keras two or three; no batch is read for it, so with ``steps_per_epoch`` over a repeated
    dataset Identity still equals plain SGD step for step."""
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16).repeat()
    models, traces = [], []
    for optimizer in (
        keras.optimizers.SGD(0.1, momentum=0.9),
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), tfs.Identity()),
    ):
        model = make_model()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer, loss, metrics=["accuracy"])
        traces.append(_count_traces(model))
        model.fit(data, steps_per_epoch=3, epochs=2, shuffle=False, verbose=0)
        models.append(model)
    assert traces[1] == [1] < traces[0]  # Keras' own optimizer is built inside the trace
    for a, b in zip(models[0].weights, models[1].weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    model = make_model()
    model.compile(tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.2)), "mse")
    traced = _count_traces(model)
    model.train_on_batch(X, np.eye(3, dtype="float32")[Y])
    assert traced == [1]


def test_a_build_the_shapes_cannot_make_is_left_to_keras():
    """When the build from the input's shapes fails (here a loss that does not fit the
    labels), it is left to the first trace, as with Keras' own optimizer: the callbacks start
    before any error."""

    class Started(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            raise RuntimeError("the callbacks started")

    for optimizer in (
        keras.optimizers.SGD(0.1),
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.2)),
    ):
        model = make_model()
        model.compile(optimizer, "mse")  # 3 outputs against labels of shape (64,)
        with pytest.raises(RuntimeError, match="the callbacks started"):
            model.fit(X, Y, epochs=1, callbacks=[Started()], verbose=0)


def _count_traces(model: keras.Model) -> list[int]:
    """A one-item list counting the traces of ``model``'s train step from now on (the step's
    Python body runs once per trace)."""
    count, train_step = [0], model.train_step

    def counted(data):
        count[0] += 1
        return train_step(data)

    model.train_step = counted
    return count


def test_a_model_built_by_its_first_call_is_left_to_keras():
    """A model without an ``Input`` is built inside the first trace, as Keras does it."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model.compile(tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(0.2)), "mse")
    history = model.fit(X, np.eye(3, dtype="float32")[Y], batch_size=16, epochs=2, verbose=0)
    assert model.optimizer.built and np.isfinite(history.history["loss"]).all()


def test_four_replicas_identity_equivalence_and_topk_training():
    out = run_python(
        """
        import numpy as np, tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 4
        )
        import keras, tf_sparsify as tfs
        from tests.test_optimizer import X, Y, compile_fit
        s = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(4)])
        SGD, Wrap = keras.optimizers.SGD, tfs.SparsifiedOptimizer
        plain, _ = compile_fit(lambda: SGD(0.1, momentum=0.9), strategy=s, epochs=1)
        ident, _ = compile_fit(
            lambda: Wrap(SGD(0.1, momentum=0.9), tfs.Identity()), strategy=s, epochs=1
        )
        diff = max(
            float(np.max(np.abs(a.numpy() - b.numpy())))
            for a, b in zip(plain.weights, ident.weights)
        )
        topk, opt = compile_fit(
            lambda: Wrap(SGD(0.1), tfs.TopK(ratio=0.1)), strategy=s, epochs=1
        )
        res = sum(float(tf.reduce_sum(tf.abs(r.value))) for r in opt.residuals)
        print("RESULT", diff, res, s.num_replicas_in_sync)
        """
    )
    diff, res, replicas = out.split("RESULT")[1].split()
    assert float(diff) < 1e-6 and float(res) > 0 and replicas == "4"


class CountingAllReduce:
    """Records the shapes of every value passed to ReplicaContext.all_reduce."""

    def __init__(self, monkeypatch):
        self.shapes = []
        original = tf.distribute.ReplicaContext.all_reduce

        def spy(ctx, reduce_op, value, options=None):
            self.shapes += [tuple(v.shape) for v in tf.nest.flatten(value)]
            return original(ctx, reduce_op, value, options)

        monkeypatch.setattr(tf.distribute.ReplicaContext, "all_reduce", spy)


def test_update_is_mean_of_decompressed_payloads_without_dense_all_reduce(mirrored2, monkeypatch):
    spy = CountingAllReduce(monkeypatch)
    with mirrored2.scope():
        v = keras.Variable(tf.zeros([10, 4]))
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(1.0), tfs.TopK(k=5))
        opt.build([v])
    raw = tf.random.stateless_normal([2, 10, 4], seed=[5, 6])

    @tf.function
    def step():
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(raw[r] / 2.0, v)])  # each replica's loss is scaled by 1/P

        mirrored2.run(replica_fn)

    step()
    expected = 0.0
    for r in range(2):
        comp = opt.compressor
        expected += comp.decompress(*comp.compress(raw[r])) / 2.0
    np.testing.assert_allclose(-v.numpy(), expected.numpy(), atol=1e-6)
    assert spy.shapes == []  # no dense (or any) all-reduce: TopK payloads travel by all-gather
    # the residual of each replica is its own accumulator minus what it sent
    per_replica = mirrored2.experimental_local_results(opt.residuals[0].value)
    for r in range(2):
        comp = opt.compressor
        sent = comp.decompress(*comp.compress(raw[r] / 2.0))
        np.testing.assert_allclose(per_replica[r].numpy(), (raw[r] / 2.0 - sent).numpy(), atol=1e-6)


def test_fp16_payloads_and_dense_small_tensors_sum_in_one_round(mirrored2):
    """FP16 kernels and fp32 biases (``skip_1d``) in one bucket: the replica context sums each
    dtype in its own call (TensorFlow packs one call's tensors into one). Integer gradients:
    the FP16 sums are exact, so the update is the mean gradient exactly."""
    with mirrored2.scope():
        variables = [keras.Variable(tf.zeros([6, 4])), keras.Variable(tf.zeros([4]))]
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(1.0), tfs.FP16(), skip_1d=True)
        opt.build(variables)
    grads = [tf.reshape(tf.range(2 * 24, dtype=tf.float32), [2, 6, 4]), tf.ones([2, 4])]

    @tf.function
    def step():
        def replica_fn():
            r = tf.distribute.get_replica_context().replica_id_in_sync_group
            opt.apply_gradients([(g[r] / 2.0, v) for g, v in zip(grads, variables, strict=True)])

        mirrored2.run(replica_fn)

    step()
    for g, v in zip(grads, variables, strict=True):
        np.testing.assert_array_equal(-v.numpy(), tf.reduce_mean(g, axis=0).numpy())


def test_counting_spy_sees_keras_dense_all_reduce(mirrored2, monkeypatch):
    spy = CountingAllReduce(monkeypatch)
    compile_fit(lambda: keras.optimizers.SGD(0.1), epochs=1, strategy=mirrored2)
    assert (8, 16) in spy.shapes  # the control: plain Keras all-reduces the dense gradients


def checkpoint_run(tmp_path, compressor, split: int, total: int):
    """Train `total` steps straight, or `split` steps, checkpoint, restore, then the rest."""

    def build():
        model = make_model()
        opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compressor)
        model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, opt

    batches = [
        (X[i % 4 * 16 : i % 4 * 16 + 16], Y[i % 4 * 16 : i % 4 * 16 + 16]) for i in range(total)
    ]
    straight, _ = build()
    for x, y in batches:
        straight.train_on_batch(x, y)
    first, opt = build()
    for x, y in batches[:split]:
        first.train_on_batch(x, y)
    path = tf.train.Checkpoint(model=first, optimizer=opt).save(str(tmp_path / "ckpt"))
    resumed, opt2 = build()
    opt2.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=opt2).restore(path).assert_consumed()
    for x, y in batches[split:]:
        resumed.train_on_batch(x, y)
    return straight, resumed, opt2


@pytest.mark.parametrize("compressor", [tfs.TopK(ratio=0.05), tfs.RandomK(ratio=0.2)], ids=repr)
def test_checkpoint_restore_then_continue_equals_not_stopping(tmp_path, compressor):
    straight, resumed, opt = checkpoint_run(tmp_path, compressor, split=5, total=9)
    for a, b in zip(straight.weights, resumed.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert int(opt.iterations.numpy()) == 9


def test_keras_file_roundtrip_keeps_residuals_and_continues(tmp_path):
    model, opt = compile_fit(
        lambda: tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), tfs.TopK(ratio=0.05)
        )
    )
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, tfs.SparsifiedOptimizer)
    assert loaded.optimizer.compressor == tfs.TopK(ratio=0.05)
    for a, b in zip(opt.residuals, loaded.optimizer.residuals, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    model.train_on_batch(X[:16], Y[:16])
    loaded.train_on_batch(X[:16], Y[:16])
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def test_config_roundtrip_and_passthrough_of_learning_rate_and_iterations():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
    opt = tfs.SparsifiedOptimizer(
        keras.optimizers.Adam(schedule), tfs.QSGD(4, bucket_size=64), scope="global", min_size=7
    )
    again = tfs.SparsifiedOptimizer.from_config(opt.get_config())
    assert again.compressor == opt.compressor and again.pipeline.options.scope == "global"
    assert again.pipeline.options.min_size == 7 and isinstance(
        again.inner_optimizer, keras.optimizers.Adam
    )
    model, opt = compile_fit(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(schedule), tfs.TopK(k=3)), epochs=1
    )
    assert int(opt.iterations.numpy()) == 4 == int(opt.inner_optimizer.iterations.numpy())
    assert float(opt.learning_rate.numpy()) == pytest.approx(0.1 * 0.5**2)


@pytest.mark.parametrize(
    "options",
    [{"clipnorm": 0.01}, {"global_clipnorm": 0.05}, {"clipvalue": 0.001}, {"weight_decay": 0.1}],
    ids=lambda o: next(iter(o)),
)
def test_inner_optimizer_options_work_as_on_the_inner(options):
    plain, _ = compile_fit(lambda: keras.optimizers.SGD(0.1, **options), epochs=1)
    wrapped, _ = compile_fit(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1, **options), tfs.Identity()),
        epochs=1,
    )
    untouched, _ = compile_fit(lambda: keras.optimizers.SGD(0.1), epochs=1)
    for a, b in zip(plain.weights, wrapped.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    assert any(
        not np.allclose(a.numpy(), b.numpy())
        for a, b in zip(plain.weights, untouched.weights, strict=True)
    )


def test_use_ema_and_gradient_accumulation_on_inner_work():
    for options in (
        {"use_ema": True},
        {"gradient_accumulation_steps": 2},
        {"loss_scale_factor": 8.0},
    ):
        plain, _ = compile_fit(lambda o=options: keras.optimizers.SGD(0.1, **o), epochs=1)
        wrapped, _ = compile_fit(
            lambda o=options: tfs.SparsifiedOptimizer(
                keras.optimizers.SGD(0.1, **o), tfs.Identity()
            ),
            epochs=1,
        )
        for a, b in zip(plain.weights, wrapped.weights, strict=True):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"compressor": "topk"}, "compressor='topk'"),
        ({"compressor": tfs.TopK(k=1), "scope": "model"}, "scope='model'"),
        ({"compressor": tfs.TopK(k=1), "min_size": -1}, "min_size=-1"),
        ({"compressor": tfs.TopK(k=1), "error_feedback": "yes"}, "error_feedback='yes'"),
        ({"compressor": tfs.TopK(k=1), "clipnorm": 1.0}, "set it on the inner optimizer"),
        ({"compressor": tfs.TopK(k=1), "momentum": 0.9}, "unknown arguments"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), **kwargs)
    with pytest.raises(ValueError, match="inner_optimizer"):
        tfs.SparsifiedOptimizer("sgd", tfs.TopK(k=1))


def test_error_feedback_defaults_follow_bias():
    assert tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), tfs.TopK(k=1)
    ).pipeline.options.error_feedback
    assert not tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), tfs.QSGD(2)
    ).pipeline.options.error_feedback
    assert tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.1), tfs.QSGD(2), error_feedback=True
    ).pipeline.options.error_feedback


def test_embedding_indexed_slices_gradients_train():
    model = embedding_model(width=4, length=3)
    opt = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.5), tfs.TopK(ratio=0.1))
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.layers[0].embeddings.numpy().copy()
    ids = np.array([[1, 2, 3], [4, 5, 6]], "int32")
    model.fit(ids, np.array([0, 1]), epochs=3, verbose=0)
    changed = np.flatnonzero(np.any(before != model.layers[0].embeddings.numpy(), axis=1))
    assert set(changed) <= {1, 2, 3, 4, 5, 6} and len(changed) > 0
    assert opt.residuals[0].shape == (50, 4)


def nan_step(opt, variables):
    grads = [tf.fill(v.shape, float("nan")) for v in variables]
    opt.apply_gradients(zip(grads, variables, strict=True))


def test_non_finite_gradients_leave_residuals_untouched():
    model, opt = compile_fit(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1)), epochs=1
    )
    before = [r.numpy().copy() for r in opt.residuals]
    nan_step(opt, model.trainable_variables)
    for b, r in zip(before, opt.residuals, strict=True):
        np.testing.assert_array_equal(b, r.numpy())


def test_mixed_precision_loss_scale_inside_skips_step_and_keeps_residuals():
    model, opt = compile_fit(
        lambda: tfs.SparsifiedOptimizer(
            keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), tfs.TopK(ratio=0.1)
        ),
        epochs=1,
    )
    lso = opt.inner_optimizer
    weights = [w.numpy().copy() for w in model.trainable_weights]
    residuals = [r.numpy().copy() for r in opt.residuals]
    scale = float(lso.dynamic_scale.numpy())
    nan_step(opt, model.trainable_variables)
    assert float(lso.dynamic_scale.numpy()) == scale / 2
    for w, v in zip(weights, model.trainable_weights, strict=True):
        np.testing.assert_array_equal(w, v.numpy())
    for r, v in zip(residuals, opt.residuals, strict=True):
        np.testing.assert_array_equal(r, v.numpy())


def test_mixed_float16_policy_wraps_ours_in_loss_scale_optimizer():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model, _ = compile_fit(
            lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.1)),
            epochs=2,
        )
        outer = model.optimizer
        assert isinstance(outer, keras.optimizers.LossScaleOptimizer)
        ours = outer.inner_optimizer
        assert isinstance(ours, tfs.SparsifiedOptimizer) and int(ours.iterations.numpy()) == 8
        weights = [w.numpy().copy() for w in model.trainable_weights]
        residuals = [r.numpy().copy() for r in ours.residuals]
        nan_step(outer, model.trainable_variables)  # the outer LSO sees the overflow first
        for w, v in zip(weights, model.trainable_weights, strict=True):
            np.testing.assert_array_equal(w, v.numpy())
        for r, v in zip(residuals, ours.residuals, strict=True):
            np.testing.assert_array_equal(r, v.numpy())
        assert all(np.all(np.isfinite(w)) for w in weights)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_compression_stats_in_history():
    keras.utils.set_random_seed(0)
    model = make_model()
    model.compile(tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=4)), "mse")
    h = model.fit(
        X, np.zeros((64, 3)), epochs=2, batch_size=16, verbose=0, callbacks=[tfs.CompressionStats()]
    )
    dense = 4 * (8 * 16 + 16 + 16 * 3 + 3)
    # k=4 float32 values from three tensors, 3 from the clamped 3-bias, and their index codes
    wire = 4 * (3 * 4 + 3) + (4 + 2 + 3 + 1)
    assert h.history["bytes_per_step"] == [wire, wire]
    assert h.history["dense_bytes_per_step"] == [dense, dense]
    assert h.history["compression_ratio"][-1] == pytest.approx(dense / wire)
    assert h.history["cumulative_bytes"] == [4 * wire, 8 * wire]


def test_compression_stats_write_tensorboard_summaries(tmp_path):
    model = make_model()
    model.compile(tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=4)), "mse")
    stats = tfs.CompressionStats(log_dir=str(tmp_path))
    model.fit(X, np.zeros((64, 3)), epochs=1, batch_size=16, verbose=0, callbacks=[stats])
    events = [os.path.join(tmp_path, f) for f in os.listdir(tmp_path)]
    tags = {
        v.tag
        for path in events
        for event in tf.compat.v1.train.summary_iterator(path)
        for v in event.summary.value
    }
    assert "compression/compression_ratio" in tags and "compression/bytes_per_step" in tags


def test_a_new_compressor_keeps_the_residual_and_conserves_exactly():
    """``set_compressor`` between steps (as automatic compression changes a setting): the
    residual carries over; dense and FP16 send it whole and empty it, TopK keeps what it does
    not select (the NumPy model: ties to the lowest index). After each step the update equals
    the model's, and update plus residual is the step's gradient plus the residual before."""
    rng = np.random.default_rng(3)
    grads = [rng.integers(-8, 9, 12).astype(np.float32) for _ in range(5)]
    settings = [tfs.TopK(k=3), tfs.Identity(), tfs.FP16(), tfs.TopK(k=2), tfs.TopK(k=5)]
    variable = keras.Variable(np.zeros(12, np.float32))
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(1.0), settings[0])
    optimizer.build([variable])
    residual = np.zeros(12, np.float32)
    for grad, compressor in zip(grads, settings, strict=True):
        optimizer.set_compressor(compressor)
        before = variable.numpy()
        tf.function(lambda g: optimizer.apply([g], [variable]))(tf.constant(grad))
        total = grad + residual
        sent = total.copy()
        if isinstance(compressor, tfs.TopK):
            keys = numpy_reference.magnitude_keys(total.view(np.uint32), "float32")
            dropped = np.setdiff1d(np.arange(12), numpy_reference.topk_select(keys, compressor.k))
            sent[dropped] = 0
        residual = total - sent
        np.testing.assert_array_equal(before - variable.numpy(), sent, err_msg=repr(compressor))
        np.testing.assert_array_equal(optimizer.residuals[0].numpy(), residual)
