"""The exchange state in ``tf.train.Checkpoint``: every replica's rows restored exactly, a
different configuration named before anything is assigned, other optimizers not fooled."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.core.replica_values import saved_value
from tf_sparsify.distribute import DelayedGradients, ServerOptimizer

RNG = np.random.default_rng(7)
X = RNG.normal(size=(64, 10)).astype("float32")
Y = (X[:, :3] @ RNG.normal(size=(3, 4))).astype("float32")
BATCHES = [(X[i : i + 16], Y[i : i + 16]) for i in range(0, 64, 16)] * 2


def _model() -> keras.Model:
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((10,)), keras.layers.Dense(12), keras.layers.Dense(4)])


def _compiled(strategy, make_optimizer) -> keras.Model:
    with strategy.scope():
        model = _model()
        model.compile(make_optimizer(), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


def _sgd_topk():
    return tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), tfs.TopK(ratio=0.2))


def _delayed():
    return ServerOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(ratio=0.2), DelayedGradients(1))


def _rows(variable) -> np.ndarray:
    """Every replica's value of a per-replica variable (Keras' or TF's)."""
    if not isinstance(variable, tf.distribute.DistributedValues):
        variable = variable.value
    return np.stack([v.numpy() for v in variable.values])


def _fit(model, epochs: int) -> None:
    model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0)


def _stopped_and_resumed(tmp_path, strategy, make_optimizer):
    """Two epochs straight, and one epoch, a checkpoint, a new model restored, one epoch."""
    straight = _compiled(strategy, make_optimizer)
    _fit(straight, 2)
    first = _compiled(strategy, make_optimizer)
    _fit(first, 1)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "c"))
    resumed = _compiled(strategy, make_optimizer)
    status = tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path)
    status.assert_consumed()
    for saved, restored in zip(first.optimizer.residuals, resumed.optimizer.residuals, strict=True):
        if saved is not None:
            np.testing.assert_array_equal(_rows(saved), _rows(restored))
    _fit(resumed, 1)
    return straight, resumed


@pytest.mark.parametrize("make_optimizer", [_sgd_topk, _delayed], ids=["sgd_momentum", "server"])
def test_mirrored_restore_then_continue_equals_not_stopping(tmp_path, mirrored2, make_optimizer):
    """Each replica gets its own residual back (they differ), so continuing is bit for bit."""
    straight, resumed = _stopped_and_resumed(tmp_path, mirrored2, make_optimizer)
    kernel = resumed.optimizer.residuals[0]
    assert not np.array_equal(*_rows(kernel))  # the replicas' residuals differ
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("late_buckets", ["none", "all"])
def test_custom_loop_exchange_restores_every_replica(tmp_path, mirrored2, late_buckets):
    """Residuals, the step and (with late buckets) the gradients in flight, per replica."""

    def make():
        with mirrored2.scope():
            exchange = tfs.GradientExchange(tfs.TopK(ratio=0.2), late_buckets=late_buckets)
            variables = [tf.Variable(tf.zeros((6, 5))), tf.Variable(tf.zeros(5))]
            exchange.build(variables)
        return exchange, variables

    def step(exchange, variables, seed):
        def replica_fn():
            rid = tf.distribute.get_replica_context().replica_id_in_sync_group
            grads = [tf.random.stateless_normal(v.shape, [seed, rid]) for v in variables]
            return exchange.updates(grads, variables)

        return tf.function(lambda: mirrored2.run(replica_fn))()

    exchange, variables = make()
    for s in range(3):
        step(exchange, variables, s)
    kept = exchange.residuals + [b for b in exchange._state.in_flight if b is not None]
    saved = [_rows(r) for r in kept]
    path = tf.train.Checkpoint(exchange=exchange).save(str(tmp_path / "e"))
    again, variables2 = make()
    tf.train.Checkpoint(exchange=again).restore(path).assert_consumed()
    restored = again.residuals + [b for b in again._state.in_flight if b is not None]
    assert len(restored) == (4 if late_buckets == "all" else 2)
    for want, got in zip(saved, restored, strict=True):
        assert not np.array_equal(*want)  # the replicas' rows differ
        np.testing.assert_array_equal(want, _rows(got))
    assert int(again.step.numpy()) == 3
    a = step(exchange, variables, 9)
    b = step(again, variables2, 9)
    for x, y in zip(
        mirrored2.experimental_local_results(a),
        mirrored2.experimental_local_results(b),
        strict=True,
    ):
        for u, v in zip(x, y, strict=True):
            np.testing.assert_array_equal(u.numpy(), v.numpy())


def _trained(make_optimizer, steps=3) -> keras.Model:
    model = _compiled(tf.distribute.get_strategy(), make_optimizer)
    for x, y in BATCHES[:steps]:
        model.train_on_batch(x, y)
    return model


@pytest.mark.parametrize(
    "other",
    [
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.QSGD(4)),
        lambda: tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.05), tfs.TopK(ratio=0.2), error_feedback=False
        ),
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(ratio=0.5)),
    ],
    ids=["qsgd", "no_error_feedback", "other_ratio"],
)
def test_another_configuration_is_named_and_nothing_is_assigned(tmp_path, other):
    """Refused before TF assigns anything: the model, the inner optimizer and the wrapper keep
    their values (the manifest is a Python state, restored before every tensor)."""
    saved = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(0.2)))
    path = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer).save(str(tmp_path / "c"))
    target = _trained(other, steps=1)
    model_before = [w.copy() for w in target.get_weights()]
    assert any(
        not np.array_equal(a, b) for a, b in zip(model_before, saved.get_weights(), strict=True)
    )
    before = [v.numpy().copy() for v in target.optimizer.variables]
    with pytest.raises(ValueError, match=r"another configuration.*TopK.*this exchange"):
        tf.train.Checkpoint(model=target, optimizer=target.optimizer).restore(path)
    for want, variable in zip(before, target.optimizer.variables, strict=True):
        np.testing.assert_array_equal(want, variable.numpy())
    for want, got in zip(model_before, target.get_weights(), strict=True):
        np.testing.assert_array_equal(want, got)


def test_another_configuration_is_refused_before_the_optimizer_is_built(tmp_path):
    saved = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(0.2)))
    path = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer).save(str(tmp_path / "c"))
    keras.utils.set_random_seed(11)
    target = keras.Sequential([keras.Input((10,)), keras.layers.Dense(12), keras.layers.Dense(4)])
    target.compile(tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.QSGD(4)), "mse")
    model_before = [w.copy() for w in target.get_weights()]
    with pytest.raises(ValueError, match=r"another configuration"):
        tf.train.Checkpoint(model=target, optimizer=target.optimizer).restore(path)
    for want, got in zip(model_before, target.get_weights(), strict=True):
        np.testing.assert_array_equal(want, got)


@pytest.mark.parametrize("distributed", [False, True], ids=["one_device", "mirrored"])
def test_a_restore_before_the_optimizer_is_built_continues_exactly(
    tmp_path, mirrored2, distributed
):
    """Deferred restoration: the values wait until ``fit`` builds the optimizer inside its
    traced step, then training continues as if it had never stopped."""
    strategy = mirrored2 if distributed else tf.distribute.get_strategy()

    def compiled() -> keras.Model:
        with strategy.scope():
            model = _model()
            model.compile(_sgd_topk(), "mse")
        return model

    straight = compiled()
    _fit(straight, 2)
    first = compiled()
    _fit(first, 1)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "c"))
    resumed = compiled()
    assert not resumed.optimizer.built
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path)
    _fit(resumed, 1)
    assert int(resumed.optimizer.iterations.numpy()) == 2 * len(X) // 16
    for a, b in zip(straight.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(straight.optimizer.residuals, resumed.optimizer.residuals, strict=True):
        np.testing.assert_array_equal(saved_value(a), saved_value(b))


def test_building_outside_the_strategy_scope_is_refused(mirrored2):
    """Per-replica residuals made outside the scope would be one variable both replicas
    share: refused as Keras refuses, naming the scope."""
    with mirrored2.scope():
        model = _model()
        optimizer = _sgd_topk()
    with pytest.raises(ValueError, match=r"MirroredStrategy.*strategy\.scope\(\)"):
        optimizer.build(model.trainable_variables)
    assert not optimizer.built and optimizer.residuals == []
    with mirrored2.scope():
        optimizer.build(model.trainable_variables)
    assert len(_rows(optimizer.residuals[0])) == 2


def test_powersgd_rank_change_fails_before_the_residuals_are_overwritten(tmp_path):
    saved = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.PowerSGD(1)))
    path = tf.train.Checkpoint(optimizer=saved.optimizer).save(str(tmp_path / "c"))
    target = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.PowerSGD(2)))
    before = [r.numpy().copy() for r in target.optimizer.residuals if r is not None]
    target.optimizer.exchange_checkpoint.accept_other_config = True  # shapes still differ
    with pytest.raises(ValueError, match=r"different.*compressor_state/0/0"):
        tf.train.Checkpoint(optimizer=target.optimizer).restore(path)
    after = [r.numpy() for r in target.optimizer.residuals if r is not None]
    for want, got in zip(before, after, strict=True):
        np.testing.assert_array_equal(want, got)


def test_residuals_carry_over_to_another_ratio_when_asked(tmp_path):
    saved = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(0.2)))
    path = tf.train.Checkpoint(optimizer=saved.optimizer).save(str(tmp_path / "c"))
    target = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(0.5)))
    target.optimizer.exchange_checkpoint.accept_other_config = True
    tf.train.Checkpoint(optimizer=target.optimizer).restore(path)
    for a, b in zip(saved.optimizer.residuals, target.optimizer.residuals, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_plain_keras_optimizer_does_not_match_our_checkpoint(tmp_path):
    """The residuals are one named entry, not positional optimizer variables: a plain SGD
    with momentum finds its slots unmatched instead of loading residuals into them."""
    saved = _trained(lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(0.2)))
    path = tf.train.Checkpoint(optimizer=saved.optimizer).save(str(tmp_path / "c"))
    plain = _trained(lambda: keras.optimizers.SGD(0.05, momentum=0.9), steps=1)
    momenta = [v.numpy().copy() for v in plain.optimizer.variables[2:]]
    status = tf.train.Checkpoint(optimizer=plain.optimizer).restore(path)
    with pytest.raises(AssertionError):
        status.assert_existing_objects_matched()
    for want, variable in zip(momenta, plain.optimizer.variables[2:], strict=True):
        np.testing.assert_array_equal(want, variable.numpy())


def test_another_replica_count_conserves_the_total_and_says_so(tmp_path, mirrored2):
    saved = _compiled(mirrored2, _sgd_topk)
    for x, y in BATCHES[:3]:
        saved.train_on_batch(x, y)
    path = tf.train.Checkpoint(optimizer=saved.optimizer).save(str(tmp_path / "c"))
    single = _compiled(tf.distribute.get_strategy(), _sgd_topk)
    with pytest.warns(UserWarning, match="total is conserved") as caught:
        tf.train.Checkpoint(optimizer=single.optimizer).restore(path)
    assert sum("total is conserved" in str(w.message) for w in caught) == 1
    for two, one in zip(saved.optimizer.residuals, single.optimizer.residuals, strict=True):
        np.testing.assert_allclose(_rows(two).sum(0), one.numpy(), rtol=1e-6, atol=1e-7)
