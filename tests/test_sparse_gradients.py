"""Sparse gradients (``tf.IndexedSlices``) stay sparse: compressed over the rows they touch,
exchanged as rows, applied as sparse updates (:mod:`tf_sparsify.core.routes.sparse_rows`).

The values are multiples of 1/8 in float64, so every sum below is exact whatever its order:
the updates, residuals and the conservation identity are compared exactly with the NumPy model
of ``tests/sparse_rows_reference.py``. Under Horovod: ``tests/horovod_workers/sparse_rows.py``.
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tests.conftest import run_python
from tests.embedding_model import TARGETS, TOKENS, VOCAB, embedding_model
from tests.sparse_rows_reference import (
    SHAPE,
    STEPS,
    cast_grads,
    cast_model,
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
    """Each step's updates (as returned, every replica's) and the final residuals of an
    exchange of a variable of the gradients' dtype given them as IndexedSlices (``sparse``) or
    densified."""
    with strategy.scope() if strategy else tf.name_scope("single"):
        variable = tf.Variable(tf.zeros(SHAPE, grads[0][0][1].dtype))
        exchange = tfs.GradientExchange(compressor, **options)
        exchange.build([variable])
    updates, residual = run_exchange(exchange, variable, grads, strategy, dense=not sparse)
    return updates, residual, exchange


def test_identity_exchanges_only_touched_rows_and_equals_the_dense_path(mirrored2):
    """Under MirroredStrategy the Identity update is IndexedSlices of the rows any replica
    touched (ascending, a row both touched summed, as in the dense gradient); densified, it is
    the dense path's update exactly."""
    grads = sparse_grads(seed=5, replicas=2)
    sparse, _, exchange = exchange_steps(tfs.Identity(), grads, mirrored2, sparse=True)
    dense, _, dense_exchange = exchange_steps(tfs.Identity(), grads, mirrored2, sparse=False)
    for step, got, want in zip(grads, sparse, dense, strict=True):
        rows = np.unique(np.concatenate([i for i, _ in step]))
        for update, expected in zip(got, want, strict=True):
            assert isinstance(update, tf.IndexedSlices)
            np.testing.assert_array_equal(update.indices, rows)
            np.testing.assert_array_equal(tf.convert_to_tensor(update), expected)
    row_bytes = 8 + 8 * SHAPE[1]  # an int64 row index and its float64 values
    touched = sum(np.unique(step[0][0]).size for step in grads)
    assert int(exchange.bytes_sent.numpy()) == row_bytes * touched
    assert int(dense_exchange.bytes_sent.numpy()) == 8 * np.prod(SHAPE) * STEPS


@pytest.mark.parametrize(
    "compressor, wire, distributed",
    [(tfs.FP16(), np.float16, False), (tfs.BF16(), ml_dtypes.bfloat16, True)],
    ids=["fp16-single", "bf16-mirrored2"],
)
def test_casts_send_the_touched_rows_and_conserve(compressor, wire, distributed, request):
    """FP16 and BF16 cast the touched rows plus their residual and send them as rows: each
    update is IndexedSlices equal to the NumPy model's, the rounding error waits in the
    residual rows, and the applied updates plus the residuals are the gradients exactly
    (:func:`cast_grads`: every sum here is exact, the casts round)."""
    strategy = request.getfixturevalue("mirrored2") if distributed else None
    grads = cast_grads(seed=12, replicas=2 if distributed else 1)
    updates, residual, exchange = exchange_steps(compressor, grads, strategy, sparse=True)
    want, want_residual = cast_model(grads, wire, divisor=1.0)
    applied = np.zeros(SHAPE)
    for got, expected in zip(updates, want, strict=True):
        for replica_update in got:
            assert isinstance(replica_update, tf.IndexedSlices)
            np.testing.assert_array_equal(tf.convert_to_tensor(replica_update), expected)
        applied += expected
    np.testing.assert_array_equal(residual, want_residual)
    assert residual.any()  # the casts rounded
    total = sum(densified(i, v) for step in grads for i, v in step)
    np.testing.assert_array_equal(applied + residual.sum(axis=0), total)
    touched = sum(np.unique(step[0][0]).size for step in grads)
    assert int(exchange.bytes_sent.numpy()) == (8 + 2 * SHAPE[1]) * touched  # int64 + 16-bit


OTHERS = {
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


@pytest.mark.parametrize("jit_compile", [False, True], ids=["plain", "xla"])
def test_a_non_finite_sparse_step_keeps_the_residual(jit_compile):
    """NaN in a sparse gradient: the step is not finite, the residual rows stay as they were
    (under XLA too, where the rows are padded)."""
    variable = tf.Variable(tf.zeros(SHAPE, tf.float64))
    exchange = tfs.GradientExchange(tfs.TopK(ratio=0.3), error_feedback=True)
    updates = tf.function(lambda g: exchange.updates([g], [variable])[0], jit_compile=jit_compile)
    good = as_slices(np.array([1, 4, 1]), np.full((3, SHAPE[1]), 0.5))
    updates(good)
    before = exchange.residuals[0].numpy()
    assert before.any()
    bad = as_slices(np.array([4, 6]), np.array([[np.nan, 1.0, 2.0], [1.0, 1.0, 1.0]]))
    update = updates(bad)
    assert np.isnan(tf.convert_to_tensor(update)).any()
    np.testing.assert_array_equal(exchange.residuals[0].numpy(), before)


# -- through Keras: an embedding model under model.fit ------------------------------------------
def fit_embedding(make_optimizer, strategy=None):
    """The embedding model (50 x 8) fitted for 2 epochs; the model and optimizer."""
    with strategy.scope() if strategy else tf.name_scope("single"):
        model = embedding_model()
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
    unseen = np.setdiff1d(np.arange(VOCAB), TOKENS)
    assert unseen.size
    model, optimizer = fit_embedding(
        lambda: tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.5), tfs.TopK(ratio=0.25)),
        mirrored2,
    )
    residual = optimizer.residuals[0]
    rows = [np.asarray(r) for r in mirrored2.experimental_local_results(residual)]
    assert all(r.shape == (VOCAB, 8) and r.any() and not r[unseen].any() for r in rows)
    before = fit_embedding(lambda: keras.optimizers.SGD(0.0), None)[0]
    loss = lambda m: float(np.mean((m.predict(TOKENS, verbose=0) - TARGETS) ** 2))  # noqa: E731
    assert loss(model) < loss(before)


class RecordingAdam(keras.optimizers.Adam):
    """Adam that notes whether each gradient it applies is ``IndexedSlices``."""

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        self.sparse_given = [isinstance(g, tf.IndexedSlices) for g in grads]
        return super().apply(grads, trainable_variables)


def train_embedding(optimizer, densify: bool) -> keras.Model:
    """The embedding model trained for 4 steps of 8 sequences in a tf.function (the
    gradients densified first with ``densify``)."""
    model = embedding_model()

    @tf.function
    def step(tokens, targets):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(tokens) - targets) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        if densify:
            grads = [tf.convert_to_tensor(g) for g in grads]
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

    for start in range(0, 32, 8):
        step(tf.constant(TOKENS[start : start + 8]), tf.constant(TARGETS[start : start + 8]))
    return model


def test_identity_hands_adam_rows_that_update_as_the_dense_gradient():
    """On one process Identity hands the inner Adam the embedding's gradient as IndexedSlices,
    a token's duplicates summed: training equals Adam's on the densified gradient. (Keras'
    Adam given the raw IndexedSlices squares each duplicate apart in its second moment.)"""
    dense = train_embedding(keras.optimizers.Adam(0.01), densify=True)
    inner = RecordingAdam(0.01)
    wrapped = train_embedding(tfs.SparsifiedOptimizer(inner, tfs.Identity()), densify=False)
    assert inner.sparse_given == [True, False, False]  # embedding, kernel, bias
    for a, b in zip(dense.weights, wrapped.weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)


def topk_embedding() -> keras.Model:
    """The embedding model compiled with TopK (5% of the touched entries, so k > 1) around
    Adam, built."""
    model = embedding_model()
    model.compile(tfs.SparsifiedOptimizer(keras.optimizers.Adam(0.01), tfs.TopK(ratio=0.05)), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def fit_steps(model: keras.Model, steps: int) -> None:
    """``steps`` steps of 8 sequences, the same ones every time."""
    model.fit(TOKENS[:16], TARGETS[:16], batch_size=8, epochs=steps // 2, shuffle=False, verbose=0)


def test_topk_rows_restored_in_a_fresh_process_continue_as_if_never_stopped(tmp_path):
    """TopK on the embedding's rows: 4 steps straight equal 2 steps, a checkpoint, and 2 more
    steps in a fresh process restored from it, exactly (weights and residual, whose rows wait
    between the steps that touch them)."""
    straight = topk_embedding()
    fit_steps(straight, 4)
    first = topk_embedding()
    fit_steps(first, 2)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(str(tmp_path / "c"))
    out = tmp_path / "resumed.npz"
    run_python(f"""
        import numpy as np
        import tensorflow as tf
        from tests.test_sparse_gradients import fit_steps, topk_embedding

        model = topk_embedding()
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
        checkpoint.restore({path!r}).assert_consumed()
        fit_steps(model, 2)
        residual = model.optimizer.residuals[0].numpy()
        np.savez({str(out)!r}, residual, *[w.numpy() for w in model.weights])
    """)
    resumed = np.load(out)
    want = [straight.optimizer.residuals[0].numpy()] + [w.numpy() for w in straight.weights]
    assert want[0].any() and len(resumed.files) == len(want)
    for name, expected in zip(resumed.files, want, strict=True):
        np.testing.assert_array_equal(resumed[name], expected)
