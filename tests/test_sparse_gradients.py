"""Sparse gradients (``tf.IndexedSlices``) stay sparse: compressed over the rows they touch,
exchanged as rows, applied as sparse updates (:mod:`tf_sparsify.sparse_rows`).

The values are multiples of 1/8 in float64, so every sum below is exact whatever its order:
the updates, residuals and the conservation identity are compared exactly with the NumPy model
of ``tests/sparse_rows_reference.py``. Under Horovod: ``tests/horovod_workers/sparse_rows.py``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tests.sparse_rows_reference import (
    SHAPE,
    STEPS,
    densified,
    entries_sent,
    sparse_grads,
    topk_model,
)


def as_slices(indices, values) -> tf.IndexedSlices:
    return tf.IndexedSlices(
        tf.constant(values, tf.float64), tf.constant(indices), tf.constant(SHAPE, tf.int64)
    )


def run_exchange(exchange, variable, grads, strategy=None, dense: bool = False):
    """Each step's update (as returned) on every replica, and the final residuals; ``dense``:
    the gradients are densified before the exchange sees them."""

    @tf.function(reduce_retracing=True)
    def one(indices, values):
        grad = tf.IndexedSlices(values, indices, SHAPE)
        return exchange.updates([tf.convert_to_tensor(grad) if dense else grad], [variable])[0]

    updates = []
    for step in grads:
        if strategy is None:
            indices, values = step[0]
            updates.append([one(tf.constant(indices), tf.constant(values))])
            continue
        inputs = [
            strategy.experimental_distribute_values_from_function(
                lambda ctx, j=j, step=step: tf.constant(step[ctx.replica_id_in_sync_group][j])
            )
            for j in range(2)
        ]
        result = strategy.run(one, args=tuple(inputs))
        updates.append(list(strategy.experimental_local_results(result)))
    residual = exchange.residuals[0]
    rows = residual if strategy is None else strategy.experimental_local_results(residual)
    return updates, np.stack([np.asarray(r) for r in ([rows] if strategy is None else rows)])


# -- TopK over the touched rows: exact updates, untouched residual rows wait, conservation -----
@pytest.mark.parametrize("distributed", [False, True], ids=["single", "mirrored2"])
def test_topk_over_touched_rows_matches_numpy_and_conserves(distributed, request):
    strategy = request.getfixturevalue("mirrored2") if distributed else None
    replicas = 2 if distributed else 1
    grads = sparse_grads(seed=3, replicas=replicas)
    scope = strategy.scope() if strategy else tf.name_scope("single")
    with scope:
        variable = tf.Variable(tf.zeros(SHAPE, tf.float64))
        exchange = tfs.GradientExchange(tfs.TopK(ratio=0.3), error_feedback=True)
        exchange.build([variable])
    updates, residual = run_exchange(exchange, variable, grads, strategy)
    want, want_residual = topk_model(grads, 0.3, divisor=1.0)
    applied = np.zeros(SHAPE)
    for got, expected in zip(updates, want, strict=True):
        for replica_update in got:  # every replica gets the same sparse update
            assert isinstance(replica_update, tf.IndexedSlices)
            np.testing.assert_array_equal(tf.convert_to_tensor(replica_update), expected)
        applied += expected
    np.testing.assert_array_equal(residual, want_residual)
    # conservation: everything applied plus every replica's residual is every gradient
    total = sum(densified(i, v) for step in grads for i, v in step)
    np.testing.assert_array_equal(applied + residual.sum(axis=0), total)
    # the residual of a row no replica ever touched stays zero, rows touched keep theirs
    touched = np.unique(np.concatenate([i for step in grads for i, _ in step]))
    untouched = np.setdiff1d(np.arange(SHAPE[0]), touched)
    assert untouched.size and not residual[:, untouched].any() and residual.any()
    # bytes (the first replica's): each entry sent is an int64 index and a float64 value
    assert int(exchange.bytes_sent.numpy()) == 16 * entries_sent(grads, 0.3, replica=0)
    assert exchange.residuals[0].shape == SHAPE  # the buffer (and checkpoints) as before


def test_topk_value_dtype_keeps_the_rounding_error_in_the_residual(mirrored2):
    """Values sent as float16 (two-byte rows through the replica context's packing): the
    rounding error stays in the residual, so conservation still holds exactly (values are
    multiples of 2**-20 below 4: float16 rounds them, float64 sums them exactly)."""
    rng = np.random.default_rng(9)
    grads = [
        [(i, rng.integers(-(2**22), 2**22, size=v.shape) / 2.0**20) for i, v in step]
        for step in sparse_grads(seed=8, replicas=2)
    ]
    with mirrored2.scope():
        variable = tf.Variable(tf.zeros(SHAPE, tf.float64))
        exchange = tfs.GradientExchange(tfs.TopK(ratio=0.3, value_dtype="float16"))
        exchange.build([variable])
    updates, residual = run_exchange(exchange, variable, grads, mirrored2)
    applied = sum(np.asarray(tf.convert_to_tensor(u[0])) for u in updates)
    assert not np.array_equal(residual, topk_model(grads, 0.3, 1.0)[1])  # rounding happened
    total = sum(densified(i, v) for step in grads for i, v in step)
    np.testing.assert_array_equal(applied + residual.sum(axis=0), total)
    assert int(exchange.bytes_sent.numpy()) == 10 * entries_sent(grads, 0.3, replica=0)


def exchange_steps(compressor, grads, strategy, sparse: bool, **options):
    """Each step's updates (densified, every replica's) and the final residuals of an exchange
    given the gradients as IndexedSlices (``sparse``) or densified."""
    with strategy.scope() if strategy else tf.name_scope("single"):
        variable = tf.Variable(tf.zeros(SHAPE, tf.float64))
        exchange = tfs.GradientExchange(compressor, **options)
        exchange.build([variable])
    updates, residual = run_exchange(exchange, variable, grads, strategy, dense=not sparse)
    return updates, residual, exchange


def test_identity_exchanges_only_touched_rows_and_equals_the_dense_path(mirrored2):
    """Under MirroredStrategy the Identity update is IndexedSlices: every replica's distinct
    rows concatenated in replica order; densified, it is the dense path's update exactly."""
    grads = sparse_grads(seed=5, replicas=2)
    sparse, _, exchange = exchange_steps(tfs.Identity(), grads, mirrored2, sparse=True)
    dense, _, dense_exchange = exchange_steps(tfs.Identity(), grads, mirrored2, sparse=False)
    for step, got, want in zip(grads, sparse, dense, strict=True):
        rows = np.concatenate([np.unique(i) for i, _ in step])
        for update, expected in zip(got, want, strict=True):
            assert isinstance(update, tf.IndexedSlices)
            np.testing.assert_array_equal(update.indices, rows)
            np.testing.assert_array_equal(tf.convert_to_tensor(update), expected)
    row_bytes = 8 + 8 * SHAPE[1]  # an int64 row index and its float64 values
    touched = sum(np.unique(step[0][0]).size for step in grads)
    assert int(exchange.bytes_sent.numpy()) == row_bytes * touched
    assert int(dense_exchange.bytes_sent.numpy()) == 8 * np.prod(SHAPE) * STEPS


OTHERS = {
    "fp16": lambda: tfs.FP16(),
    "qsgd": lambda: tfs.QSGD(levels=4, seed=1),
    "randomk": lambda: tfs.RandomK(ratio=0.5, seed=1),
    "terngrad": lambda: tfs.TernGrad(seed=1),
    "scaled_sign": lambda: tfs.ScaledSign(),
    "powersgd": lambda: tfs.PowerSGD(rank=1, seed=1),
    "sparse_allreduce": lambda: tfs.SparseAllReduce(k=4),
}


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_other_compressors_densify_and_lose_nothing(name):
    """Compressors whose exchange is dense by construction densify a sparse gradient: the
    updates and residuals equal the dense path's exactly (no gradient mass is lost)."""
    grads = sparse_grads(seed=7, replicas=1, steps=2)
    sparse, sparse_residual, _ = exchange_steps(OTHERS[name](), grads, None, sparse=True)
    dense, dense_residual, _ = exchange_steps(OTHERS[name](), grads, None, sparse=False)
    for got, want in zip(sparse, dense, strict=True):
        assert not isinstance(got[0], tf.IndexedSlices)
        np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(sparse_residual, dense_residual)


def test_a_non_finite_sparse_step_keeps_the_residual():
    """NaN in a sparse gradient: the step is not finite, the residual rows stay as they were."""
    variable = tf.Variable(tf.zeros(SHAPE, tf.float64))
    exchange = tfs.GradientExchange(tfs.TopK(ratio=0.3), error_feedback=True)
    good = as_slices(np.array([1, 4, 1]), np.full((3, SHAPE[1]), 0.5))
    exchange.updates([good], [variable])
    before = exchange.residuals[0].numpy()
    assert before.any()
    bad = as_slices(np.array([4, 6]), np.array([[np.nan, 1.0, 2.0], [1.0, 1.0, 1.0]]))
    update = exchange.updates([bad], [variable])[0]
    assert np.isnan(tf.convert_to_tensor(update)).any()
    np.testing.assert_array_equal(exchange.residuals[0].numpy(), before)


# -- through Keras: an embedding model under model.fit ------------------------------------------
TOKENS = np.random.default_rng(11).integers(0, 50, size=(32, 4))
TARGETS = np.random.default_rng(12).normal(size=(32, 2)).astype("float32")


def fit_embedding(make_optimizer, strategy=None):
    """An embedding (50 x 8) and a dense head, fitted for 2 epochs; the model and optimizer."""
    with strategy.scope() if strategy else tf.name_scope("single"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(50, 8),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(2),
            ]
        )
        optimizer = make_optimizer()
        model.compile(optimizer, "mse")
    model.fit(TOKENS, TARGETS, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return model, optimizer


@pytest.mark.parametrize(
    "inner, distributed", [("sgd", False), ("sgd_momentum", True)], ids=["single", "mirrored2"]
)
def test_identity_on_an_embedding_equals_the_plain_optimizer(inner, distributed, request):
    """Identity hands the embedding's gradient to the inner optimizer as IndexedSlices (its
    sparse update); training equals the plain optimizer's, and only touched rows travel.
    (An inner optimizer whose sparse update is not linear in the gradient, Adagrad's squares,
    sees each replica's duplicate indices combined, as in the dense gradient, where plain Keras
    squares each duplicate apart.)"""
    strategy = request.getfixturevalue("mirrored2") if distributed else None
    make = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    }
    plain, _ = fit_embedding(make[inner], strategy)
    wrapped, optimizer = fit_embedding(
        lambda: tfs.SparsifiedOptimizer(make[inner](), tfs.Identity()), strategy
    )
    for a, b in zip(plain.weights, wrapped.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    sent, dense = int(optimizer.bytes_sent.numpy()), int(optimizer.dense_bytes.numpy())
    assert 0 < sent < dense  # 8 batches of at most 8 x 4 tokens: at most 32 of 50 rows each


def test_topk_on_an_embedding_keeps_rows_residuals_and_trains(mirrored2):
    """TopK under MirroredStrategy on the embedding's touched rows: residuals of the full
    shape per replica, untouched rows' residual zero, the loss goes down."""
    unseen = np.setdiff1d(np.arange(50), TOKENS)
    assert unseen.size
    model, optimizer = fit_embedding(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.5), tfs.TopK(ratio=0.25)),
        mirrored2,
    )
    residual = optimizer.residuals[0]
    rows = [np.asarray(r) for r in mirrored2.experimental_local_results(residual)]
    assert all(r.shape == (50, 8) and r.any() and not r[unseen].any() for r in rows)
    before = fit_embedding(lambda: keras.optimizers.SGD(0.0), None)[0]
    loss = lambda m: float(np.mean((m.predict(TOKENS, verbose=0) - TARGETS) ** 2))  # noqa: E731
    assert loss(model) < loss(before)
