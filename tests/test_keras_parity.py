"""SparsifiedOptimizer as a drop-in Keras optimizer: variables without gradients, options, Keras'
own wrappers and callbacks around it, weights, recompiling. Each case runs the same thing with
the plain inner optimizer and with ``SparsifiedOptimizer(inner, ...)``."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.distribute import DelayedGradients, ServerOptimizer
from tf_sparsify.keras.inner_options import INNER_OPTIONS

rng = np.random.default_rng(1)
X = rng.normal(size=(64, 8)).astype("float32")
Y = rng.normal(size=(64, 3)).astype("float32")


def two_branch_model(seed: int = 0, with_unused: bool = True) -> keras.Model:
    """Dense -> Dense, plus (optionally) a built layer the loss never reaches."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(inputs)
    outputs = keras.layers.Dense(3, name="head")(hidden)
    model = keras.Model(inputs, outputs)
    if with_unused:
        unused = keras.layers.Dense(5, name="unused")
        unused.build((None, 8))
        model._tracker.unlock()
        model.unused = unused  # tracked: its variables are trainable but get no gradient
    return model


def fit(model: keras.Model, optimizer, epochs: int = 2, **kwargs) -> keras.Model:
    model.compile(optimizer, "mse", **kwargs)
    model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)
    return model


def weights_of(model: keras.Model, prefix: str) -> list[np.ndarray]:
    return [v.numpy() for v in model.trainable_variables if v.path.startswith(prefix)]


def assert_same(a, b, rtol=1e-6, atol=1e-7) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# -- 1. variables without gradients under scope="global" ------------------------------------------
def test_global_scope_trains_the_variables_that_have_gradients():
    """A layer the loss never reaches must not stop the others from training (it used to stop
    all of them: the whole global unit was skipped)."""
    make = lambda: tfs.SparsifiedOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.3), scope="global"
    )
    model = two_branch_model()
    unused_before = weights_of(model, "unused")
    with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
        opt = fit(model, make()).optimizer
    reference = fit(two_branch_model(with_unused=False), make())
    for prefix in ("hidden", "head"):
        assert_same(weights_of(model, prefix), weights_of(reference, prefix))
    assert_same(weights_of(model, "unused"), unused_before)
    assert not np.allclose(weights_of(model, "head")[0], weights_of(two_branch_model(), "head")[0])
    for residual, variable in zip(opt.residuals, opt._trainable_variables, strict=True):
        if "unused" in variable.path:  # left alone, residual included
            assert not np.any(residual.numpy())
    sent = int(opt.bytes_sent.numpy())
    assert sent == int(reference.optimizer.bytes_sent.numpy()) > 0


def test_global_scope_after_freezing_a_layer_and_recompiling():
    make = lambda: tfs.SparsifiedOptimizer(  # noqa: E731
        keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.3), scope="global"
    )
    model = fit(two_branch_model(with_unused=False), make(), epochs=1)
    model.get_layer("hidden").trainable = False
    frozen = weights_of(model, "hidden")
    head = weights_of(model, "head")
    fit(model, model.optimizer, epochs=1)
    assert_same(weights_of(model, "hidden"), frozen)
    assert not np.allclose(weights_of(model, "head")[0], head[0])


def test_server_optimizer_global_scope_trains_the_variables_that_have_gradients():
    def run(with_unused: bool) -> keras.Model:
        model = two_branch_model(with_unused=with_unused)
        opt = ServerOptimizer(
            keras.optimizers.SGD(0.1), tfs.TopK(ratio=0.3), DelayedGradients(1), scope="global"
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return fit(model, opt)

    model, reference = run(True), run(False)
    for prefix in ("hidden", "head"):
        assert_same(weights_of(model, prefix), weights_of(reference, prefix))
    assert_same(weights_of(model, "unused"), weights_of(two_branch_model(), "unused"))
    assert not np.allclose(weights_of(model, "head")[0], weights_of(two_branch_model(), "head")[0])


# -- 2. Keras parity -------------------------------------------------------------------------------
@pytest.mark.parametrize("option", INNER_OPTIONS)
@pytest.mark.parametrize("value", [None, 0.99, 2])
def test_base_options_on_the_wrapper_are_rejected_whatever_their_value(option, value):
    with pytest.raises(ValueError, match=f"does not take `{option}`.*{option}={value!r}"):
        tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.Identity(), **{option: value})


def test_exclude_from_weight_decay_reaches_the_inner_optimizer():
    def run(wrap: bool, exclude: bool) -> keras.Model:
        opt = keras.optimizers.AdamW(0.05, weight_decay=0.5)
        if wrap:
            opt = tfs.SparsifiedOptimizer(opt, tfs.Identity())
        if exclude:
            opt.exclude_from_weight_decay(var_names=["bias"])
        return fit(two_branch_model(with_unused=False), opt)

    plain = run(wrap=False, exclude=True)
    assert_same(run(wrap=True, exclude=True).trainable_weights, plain.trainable_weights)
    decayed = run(wrap=True, exclude=False)
    assert not np.allclose(decayed.trainable_weights[1], plain.trainable_weights[1])


def test_no_gradients_at_all_raise_and_missing_ones_warn_as_in_keras():
    for make in (
        lambda: keras.optimizers.SGD(0.1),
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2)),
    ):
        v, w = keras.Variable(tf.ones([4])), keras.Variable(tf.ones([3]))
        opt = make()
        with pytest.raises(ValueError, match="No gradients provided for any variable"):
            opt.apply([None, None], [v, w])
        with pytest.warns(UserWarning, match="Gradients do not exist for variables"):
            opt.apply([tf.ones([4]), None], [v, w])
        np.testing.assert_array_equal(w.numpy(), np.ones(3))
        assert not np.allclose(v.numpy(), 1.0)


def lso(inner, initial_scale=64.0):
    return keras.optimizers.LossScaleOptimizer(inner, initial_scale=initial_scale)


def multi(inner, loss_scale_factor=None):
    return keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(default_optimizer=inner), loss_scale_factor=loss_scale_factor
    )


@pytest.mark.parametrize(
    "outer",
    [
        pytest.param(lambda inner: lso(inner), id="LossScaleOptimizer"),
        pytest.param(lambda inner: multi(inner, loss_scale_factor=8.0), id="MultiOptimizer"),
    ],
)
def test_keras_wrappers_set_the_loss_scale_factor_of_the_inner_optimizer(outer):
    """LossScaleOptimizer clears its child's factor (it scales itself); MultiOptimizer sets its
    own: either way the factor must reach the optimizer that unscales the update."""
    sgd = lambda: keras.optimizers.SGD(0.1, loss_scale_factor=4.0)  # noqa: E731
    plain = fit(two_branch_model(with_unused=False), outer(sgd()))
    wrapped_opt = outer(tfs.SparsifiedOptimizer(sgd(), tfs.Identity()))
    wrapped = fit(two_branch_model(with_unused=False), wrapped_opt)
    assert_same(wrapped.trainable_weights, plain.trainable_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "outer",
    [
        pytest.param(lambda inner: inner, id="alone"),
        pytest.param(lambda inner: lso(inner), id="LossScaleOptimizer"),
        pytest.param(lambda inner: multi(inner), id="MultiOptimizer"),
    ],
)
def test_swap_ema_weights_works_with_the_wrapper_inside_keras_wrappers(outer):
    def run(wrap: bool) -> tuple[keras.Model, float]:
        inner = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
        opt = outer(tfs.SparsifiedOptimizer(inner, tfs.Identity()) if wrap else inner)
        model = two_branch_model(with_unused=False)
        model.compile(opt, "mse")
        history = model.fit(
            X,
            Y,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(X, Y),
            callbacks=[keras.callbacks.SwapEMAWeights()],
        )
        return model, history.history["val_loss"][-1]

    (plain, plain_loss), (wrapped, wrapped_loss) = run(False), run(True)
    assert wrapped_loss == pytest.approx(plain_loss, rel=1e-6)
    assert_same(wrapped.trainable_weights, plain.trainable_weights)


def test_inner_options_read_and_write_through_the_wrapper():
    inner = keras.optimizers.SGD(0.1, clipnorm=1.5, use_ema=True, loss_scale_factor=2.0)
    opt = tfs.SparsifiedOptimizer(inner, tfs.Identity())
    assert (opt.clipnorm, opt.use_ema, opt.loss_scale_factor, opt.ema_momentum) == (
        1.5,
        True,
        2.0,
        0.99,
    )
    opt.clipnorm = 0.5
    opt.loss_scale_factor = None
    assert inner.clipnorm == 0.5 and inner.loss_scale_factor is None


def test_set_weights_and_get_weights_round_trip_the_inner_state():
    make = lambda: tfs.SparsifiedOptimizer(  # noqa: E731
        keras.optimizers.Adam(0.01), tfs.TopK(ratio=0.3)
    )
    trained = fit(two_branch_model(with_unused=False), make(), epochs=1)
    state = trained.optimizer.get_weights()
    assert len(state) == len(trained.optimizer.variables) > len(trained.optimizer._variables)
    fresh = two_branch_model(with_unused=False)
    fresh.compile(make(), "mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.set_weights(trained.get_weights())
    fresh.optimizer.set_weights(state)
    assert_same(fresh.optimizer.get_weights(), state, rtol=0, atol=0)
    for model in (trained, fresh):
        model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_same(fresh.trainable_weights, trained.trainable_weights)
    with pytest.raises(ValueError, match="must hold"):
        fresh.optimizer.set_weights(state[:-1])


def test_unfreezing_and_recompiling_raises_keras_value_error():
    for make in (
        lambda: keras.optimizers.SGD(0.1),
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2)),
    ):
        model = two_branch_model(with_unused=False)
        model.get_layer("hidden").trainable = False
        opt = make()
        fit(model, opt, epochs=1)
        model.get_layer("hidden").trainable = True
        with pytest.raises(ValueError, match="Unknown variable"):
            fit(model, opt, epochs=1)


# -- the public methods of keras.optimizers.Optimizer, one by one -------------------------------
def paired(check) -> None:
    """Run ``check(make)`` for the plain inner optimizer and the Identity wrapper of it; both
    must give the same result."""
    results = []
    for wrap in (False, True):

        def make(inner: keras.optimizers.Optimizer, wrap: bool = wrap):
            return tfs.SparsifiedOptimizer(inner, tfs.Identity()) if wrap else inner

        results.append(check(make))
    assert_same(results[0], results[1])


def test_learning_rate_setter_and_schedule_through_the_wrapper():
    def check(make):
        opt = make(keras.optimizers.SGD(0.1))
        model = fit(two_branch_model(with_unused=False), opt, epochs=1)
        opt.learning_rate = 0.02
        model.fit(X, Y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return [float(opt.learning_rate), *model.trainable_weights]

    paired(check)


def test_apply_gradients_apply_without_variables_and_iterations():
    def check(make):
        v = keras.Variable(np.arange(4.0, dtype="float32"))
        opt = make(keras.optimizers.SGD(0.5, momentum=0.5))
        returned = opt.apply_gradients([(tf.ones([4]), v)])
        opt.apply([tf.fill([4], 2.0)])  # built: variables may be left out
        opt.apply([])  # a no-op, as in Keras
        return [int(returned), int(opt.iterations), v.numpy()]

    paired(check)


def test_scale_loss_finalize_and_save_own_variables():
    def check(make):
        opt = make(keras.optimizers.SGD(0.1, loss_scale_factor=4.0, use_ema=True))
        model = fit(two_branch_model(with_unused=False), opt, epochs=1)
        opt.finalize_variable_values(model.trainable_variables)  # EMA into the model
        store: dict = {}
        opt.save_own_variables(store)
        return [float(opt.scale_loss(tf.constant(1.5))), *model.trainable_weights, len(store) > 0]

    paired(check)


def test_stateless_apply_and_update_step_are_not_available_on_tensorflow():
    inner = keras.optimizers.SGD(0.1)
    opt = tfs.SparsifiedOptimizer(inner, tfs.Identity())
    v = keras.Variable(tf.ones([2]))
    opt.build([v])
    inner_error = pytest.raises(ValueError, match="not supported with the TensorFlow backend")
    with inner_error:
        inner.stateless_apply(inner.variables, [tf.ones([2])], [v])
    with pytest.raises(ValueError, match="not supported with the TensorFlow backend"):
        opt.stateless_apply(opt.variables, [tf.ones([2])], [v])
    with pytest.raises(NotImplementedError, match="only through apply"):
        opt.update_step(tf.ones([2]), v, 0.1)


def test_residuals_stay_in_gradient_units_when_an_inner_loss_scale_changes():
    """With a LossScaleOptimizer inside, the gradients arrive scaled by its dynamic scale,
    which halves on an overflow and doubles after growth steps; the residuals must not mix
    scales. Same run without loss scaling, skipping the bad step: same weights and residuals."""
    rng = np.random.default_rng(5)
    shapes = [(20, 4), (4,)]
    steps = [[rng.normal(size=s).astype("float32") for s in shapes] for _ in range(7)]
    steps[3][0][2, 1] = np.nan  # an overflow: the scale halves and the step is skipped

    def run(scaled: bool):
        variables = [keras.Variable(np.zeros(s, "float32")) for s in shapes]
        inner = keras.optimizers.SGD(0.1)
        if scaled:
            inner = keras.optimizers.LossScaleOptimizer(
                inner, initial_scale=2.0**10, dynamic_growth_steps=2
            )
        opt = tfs.SparsifiedOptimizer(inner, tfs.TopK(ratio=0.2))
        scales = []
        for t, grads in enumerate(steps):
            if not scaled and t == 3:
                continue  # the unscaled run simply skips the bad step
            scale = float(inner.dynamic_scale.numpy()) if scaled and opt.built else 2.0**10
            factor = scale if scaled else 1.0
            opt.apply([tf.constant(g * factor) for g in grads], variables)
            scales.append(scale)
        return variables, opt.residuals, scales

    (w_scaled, r_scaled, scales), (w_plain, r_plain, _) = run(True), run(False)
    changes = [b / a for a, b in zip(scales, scales[1:], strict=False) if a != b]
    assert 2.0 in changes and 0.5 in changes  # the scale went up and down during the run
    assert_same(w_scaled, w_plain)
    assert_same([r.numpy() for r in r_scaled], [r.numpy() for r in r_plain])
