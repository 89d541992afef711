"""Sparse gradients (``tf.IndexedSlices``) under ``horovodrun -np 2``: only touched rows travel.

Every rank knows every rank's gradients (seeded), so each rank checks the exchange against the
NumPy model of ``tests/sparse_rows_reference.py`` (exact: values are multiples of 1/8 and the
division by 2 is exact). The row counts differ by rank and step, and the plan check passes;
a variable whose gradient is sparse on one rank and dense on the other is a named error.
"""

from __future__ import annotations

import time

import keras
import ml_dtypes
import numpy as np
import tensorflow as tf
from common import Checks, hvd

import tf_sparsify as tfs
import tf_sparsify.horovod as th
from tests.embedding_model import embedding_model
from tests.sparse_rows_reference import (
    SHAPE,
    cast_grads,
    cast_model,
    densified,
    entries_sent,
    sparse_grads,
    topk_model,
)

SIZE, RANK = hvd.size(), hvd.rank()
MAX_SECONDS = 30


def run(exchange, grads, dense: bool = False) -> tuple[list, np.ndarray]:
    """This rank's update at each step (in a tf.function, as model.fit runs it) and its final
    residual (zeros without one)."""
    variable = tf.Variable(tf.zeros(SHAPE, grads[0][RANK][1].dtype))
    exchange.build([variable])  # before the step is traced (else it is traced twice)

    @tf.function(reduce_retracing=True)
    def one(indices, values):
        grad = tf.IndexedSlices(values, indices, SHAPE)
        return exchange.updates([tf.convert_to_tensor(grad) if dense else grad], [variable])[0]

    updates = [one(tf.constant(step[RANK][0]), tf.constant(step[RANK][1])) for step in grads]
    residual = exchange.residuals[0]
    return updates, np.zeros(SHAPE) if residual is None else residual.numpy()


def identity_rows() -> dict:
    """Identity: the update is IndexedSlices of the rows any rank touched (ascending, a row
    several ranks touched summed), divided by 2; densified, exactly the dense path's; fewer
    bytes handed to Horovod."""
    grads = sparse_grads(seed=21, replicas=SIZE)
    sparse_exchange, dense_exchange = th.GradientExchange(tfs.Identity()), th.GradientExchange()
    sparse, _ = run(sparse_exchange, grads)
    dense, _ = run(dense_exchange, grads, dense=True)
    for step, got, want in zip(grads, sparse, dense, strict=True):
        if not isinstance(got, tf.IndexedSlices):
            raise AssertionError(f"the update is {type(got).__name__}, not IndexedSlices")
        np.testing.assert_array_equal(got.indices, np.unique(np.concatenate([i for i, _ in step])))
        np.testing.assert_array_equal(tf.convert_to_tensor(got), want)
        np.testing.assert_array_equal(want, sum(densified(i, v) for i, v in step) / SIZE)
    row_bytes = 8 + 8 * SHAPE[1]
    touched = sum(np.unique(step[RANK][0]).size for step in grads)
    if int(sparse_exchange.bytes_sent.numpy()) != row_bytes * touched:
        raise AssertionError(f"bytes_sent {int(sparse_exchange.bytes_sent.numpy())}")
    to_horovod = int(sparse_exchange.bytes_to_horovod.numpy())
    dense_to_horovod = int(dense_exchange.bytes_to_horovod.numpy())
    if not 0 < to_horovod < dense_to_horovod:
        raise AssertionError(f"bytes to Horovod: sparse {to_horovod}, dense {dense_to_horovod}")
    return {"bytes_to_horovod": to_horovod, "dense_bytes_to_horovod": dense_to_horovod}


def _conserves(grads, updates, residual, want, want_residual) -> None:
    """Every update is IndexedSlices equal to the model's ``want``, this rank's residual is
    ``want_residual[RANK]``, and applied + every rank's residual == every gradient."""
    applied = np.zeros(SHAPE)
    for got, expected in zip(updates, want, strict=True):
        if not isinstance(got, tf.IndexedSlices):
            raise AssertionError(f"the update is {type(got).__name__}, not IndexedSlices")
        np.testing.assert_array_equal(tf.convert_to_tensor(got), expected)
        applied += expected
    np.testing.assert_array_equal(residual, want_residual[RANK])
    every = np.stack(hvd.allgather_object(residual))
    total = sum(densified(i, v) for step in grads for i, v in step)
    np.testing.assert_array_equal(SIZE * applied + every.sum(axis=0), total)


def topk_rows_conserve() -> dict:
    """TopK over touched rows with error feedback: every update and this rank's residual
    equal the model; applied + every rank's residual == every gradient."""
    grads = sparse_grads(seed=22, replicas=SIZE)
    exchange = th.GradientExchange(tfs.TopK(ratio=0.3), error_feedback=True)
    updates, residual = run(exchange, grads)
    _conserves(grads, updates, residual, *topk_model(grads, 0.3, divisor=SIZE))
    sent = int(exchange.bytes_sent.numpy())
    if sent != 16 * entries_sent(grads, 0.3, RANK):
        raise AssertionError(f"bytes_sent {sent}")
    return {"bytes_sent": sent}


def cast_rows_conserve() -> dict:
    """BF16 over touched rows with error feedback (its rows travel as int16 bits): every
    update is IndexedSlices equal to the model's, this rank's residual too; applied + every
    rank's residual == every gradient."""
    grads = cast_grads(seed=24, replicas=SIZE)
    updates, residual = run(th.GradientExchange(tfs.BF16()), grads)
    _conserves(grads, updates, residual, *cast_model(grads, ml_dtypes.bfloat16, divisor=SIZE))
    return {"residual_rows": int(np.any(residual, axis=1).sum())}


def embedding_fit() -> dict:
    """DistributedOptimizer(SGD, TopK) fits an embedding model (sparse gradients under
    model.fit); the ranks' weights stay identical."""
    rng = np.random.default_rng(RANK)
    tokens, targets = rng.integers(0, 40, size=(32, 4)), rng.normal(size=(32, 2))
    model = embedding_model(vocab=40, width=6)
    optimizer = th.DistributedOptimizer(keras.optimizers.SGD(0.2), tfs.TopK(ratio=0.3))
    model.compile(optimizer, "mse", jit_compile=False)
    model.fit(tokens, targets, batch_size=8, epochs=2, verbose=0)
    every = hvd.allgather_object([w.numpy() for w in model.weights], name="sparse_rows_weights")
    for a, b in zip(every[0], every[1], strict=True):
        np.testing.assert_array_equal(a, b)
    sent, dense = int(optimizer.bytes_sent.numpy()), int(optimizer.dense_bytes.numpy())
    if not 0 < sent < dense:
        raise AssertionError(f"bytes_sent {sent} of dense {dense}")
    return {"bytes_sent": sent, "dense_bytes": dense}


def sparse_on_one_rank() -> dict:
    """Rank 1 densifies the gradient rank 0 sends as rows: a named error, not a hang."""
    step = sparse_grads(seed=23, replicas=SIZE, steps=1)[0][RANK]
    grad = tf.IndexedSlices(tf.constant(step[1]), tf.constant(step[0]), SHAPE)
    grad = tf.convert_to_tensor(grad) if RANK == 1 else grad
    variable = tf.Variable(tf.zeros(SHAPE, tf.float64))
    start = time.perf_counter()
    try:
        th.GradientExchange(tfs.TopK(ratio=0.3)).updates([grad], [variable])
    except tf.errors.InvalidArgumentError as error:
        seconds = time.perf_counter() - start
        if "differ in their variables with sparse gradients" not in str(error):
            raise AssertionError(f"error does not name the sparse gradients: {error}") from error
        if seconds > MAX_SECONDS:
            raise AssertionError(f"the error took {seconds:.1f} s") from error
        return {"error_seconds": round(seconds, 2)}
    raise AssertionError("no error although one rank's gradient is sparse and the other's dense")


def main() -> None:
    checks = Checks()
    checks.run("identity_rows", identity_rows)
    checks.run("topk_rows_conserve", topk_rows_conserve)
    checks.run("cast_rows_conserve", cast_rows_conserve)
    checks.run("embedding_fit", embedding_fit)
    checks.run("sparse_on_one_rank", sparse_on_one_rank)
    checks.exit()


if __name__ == "__main__":
    main()
