"""IAG: the server table holds each worker's last contribution; the update is its sum."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.distribute import IAG, ServerOptimizer

DIM = 4


def _run(server, grads: np.ndarray):
    """Feed per-worker gradients ``[steps, P, DIM]`` to SGD(1); return updates and tables."""
    workers = grads.shape[1]
    w = keras.Variable(np.zeros(DIM, "float32"))
    opt = ServerOptimizer(keras.optimizers.SGD(1.0), tfs.Identity(), server, workers=workers)
    opt.build([w])
    step = tf.function(lambda g: opt.apply([g], [w]))
    deltas, tables, before = [], [], w.numpy()
    for g in grads:
        step(tf.constant(g))
        deltas.append(before - w.numpy())
        tables.append(opt.tables[0].numpy())
        before = w.numpy()
    return np.array(deltas), np.array(tables)


def _by_hand(grads: np.ndarray, refreshed: list[np.ndarray]):
    """The IAG table and update, step by step, from the refresh masks."""
    workers = grads.shape[1]
    table = np.zeros((workers, DIM), "float32")
    deltas, tables = [], []
    for g, mask in zip(grads, refreshed, strict=True):
        table = np.where(mask[:, None], g / workers, table)
        deltas.append(table.sum(axis=0))
        tables.append(table.copy())
    return np.array(deltas), np.array(tables)


@pytest.mark.parametrize("workers, num_refresh", [(3, 1), (4, 2)])
def test_cyclic_refresh_table_semantics(workers, num_refresh):
    steps = 9
    grads = np.random.default_rng(0).normal(size=(steps, workers, DIM)).astype("float32")
    server = IAG("cyclic", num_refresh=num_refresh)
    masks = [np.ones(workers, bool)]  # step 0: everyone fills the table
    for t in range(1, steps):
        mask = np.zeros(workers, bool)
        mask[[(t * num_refresh + j) % workers for j in range(num_refresh)]] = True
        masks.append(mask)
    np.testing.assert_array_equal(
        [server.refreshed(t, workers).numpy() for t in range(steps)], masks
    )
    deltas, tables = _run(server, grads)
    want_deltas, want_tables = _by_hand(grads, masks)
    np.testing.assert_allclose(tables, want_tables, atol=1e-6)
    np.testing.assert_allclose(deltas, want_deltas, atol=1e-6)
    # the update is the average of the workers' last gradients, not this step's average
    assert np.abs(deltas[1:] - grads[1:].mean(axis=1)).max() > 1e-2
    assert server.staleness(workers) == workers // num_refresh - 1


def test_random_refresh_picks_a_seeded_subset_of_the_given_size():
    workers, steps = 5, 40
    server = IAG("random", num_refresh=2, seed=3)
    masks = np.array([server.refreshed(t, workers).numpy() for t in range(steps)])
    again = np.array([IAG("random", 2, seed=3).refreshed(t, workers).numpy() for t in range(steps)])
    other = np.array([IAG("random", 2, seed=4).refreshed(t, workers).numpy() for t in range(steps)])
    np.testing.assert_array_equal(masks, again)
    assert not np.array_equal(masks, other)
    assert masks[0].all() and (masks[1:].sum(axis=1) == 2).all()
    assert masks[1:].sum(axis=0).min() > 5  # every worker gets picked
    assert server.staleness(workers) is None
    grads = np.random.default_rng(1).normal(size=(steps, workers, DIM)).astype("float32")
    deltas, tables = _run(server, grads)
    want_deltas, want_tables = _by_hand(grads, list(masks))
    np.testing.assert_allclose(tables, want_tables, atol=1e-6)
    np.testing.assert_allclose(deltas, want_deltas, atol=1e-6)


def test_refreshing_everyone_is_synchronous_training():
    grads = np.random.default_rng(2).normal(size=(5, 3, DIM)).astype("float32")
    deltas, _ = _run(IAG("cyclic", num_refresh=3), grads)
    np.testing.assert_allclose(deltas, grads.mean(axis=1), atol=1e-6)


def test_a_non_finite_step_refreshes_nothing():
    grads = np.random.default_rng(3).normal(size=(3, 3, DIM)).astype("float32")
    grads[2, 2, 1] = np.inf  # step 2 refreshes worker 2 in the cyclic order
    deltas, tables = _run(IAG(), grads)
    assert np.isnan(deltas[2]).all()
    np.testing.assert_array_equal(tables[2], tables[1])


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: IAG("round_robin"), "refresh.*round_robin"),
        (lambda: IAG(num_refresh=0), "num_refresh.*0"),
        (lambda: IAG(num_refresh=1.0), "num_refresh.*1.0"),
        (lambda: IAG(seed=-2), "seed.*-2"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_more_refreshes_than_workers_is_rejected_at_build():
    opt = ServerOptimizer(keras.optimizers.SGD(), tfs.Identity(), IAG(num_refresh=3), workers=2)
    with pytest.raises(ValueError, match="num_refresh.*3"):
        opt.build([keras.Variable(np.zeros(DIM, "float32"))])
