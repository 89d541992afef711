"""Restarts under ``horovodrun -np 2``: one checkpoint written by rank 0 holds every rank's error
memory (after ``gather_error_memory``), and restore-then-continue equals not stopping, bit for
bit, for the Keras front end and ``GradientExchange``, restored on every rank or on rank 0 with a
broadcast. Without the gather, a rank whose rows are missing is warned, not silently fed rank
0's residuals. Each check reports the max weight difference against an uninterrupted run.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import keras
import numpy as np
import tensorflow as tf
from common import Checks, hvd

import tf_sparsify as tfs
import tf_sparsify.horovod as th

RANK = hvd.rank()
X = np.random.default_rng(10 + RANK).normal(size=(64, 8)).astype("float32")
Y = (X[:, :2].sum(1, keepdims=True) > 0).astype("float32")
LOSS = keras.losses.MeanSquaredError()
FOLDER = hvd.broadcast_object(tempfile.mkdtemp() if RANK == 0 else None)


def model_and_optimizer() -> tuple[keras.Model, th.DistributedOptimizer]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6), keras.layers.Dense(1)])
    optimizer = th.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), tfs.TopK(ratio=0.2)
    )
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
    optimizer.build(model.trainable_variables)
    return model, optimizer


def fit(model, epochs: int = 1, callbacks=()) -> None:
    model.fit(X, Y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


def max_difference(a: keras.Model, b: keras.Model) -> float:
    return max(
        float(np.max(np.abs(u - v))) for u, v in zip(a.get_weights(), b.get_weights(), strict=True)
    )


def keras_restart(name: str, gather: bool, restore_on: str) -> dict:
    straight, _ = model_and_optimizer()
    fit(straight, 2)
    first, optimizer = model_and_optimizer()
    fit(first, 1)
    if gather:
        th.gather_error_memory(optimizer)
    path = os.path.join(FOLDER, name)
    if RANK == 0:
        tf.train.Checkpoint(model=first, optimizer=optimizer).write(path)
    hvd.allreduce(tf.constant(0.0), name=f"{name}_written")
    resumed, optimizer2 = model_and_optimizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if restore_on == "every_rank" or RANK == 0:
            tf.train.Checkpoint(model=resumed, optimizer=optimizer2).read(path)
    callbacks = [th.BroadcastGlobalVariablesCallback(0)] if restore_on == "rank0" else []
    fit(resumed, 1, callbacks)
    starts_from_zero = any("starts from zero" in str(w.message) for w in caught)
    return {"max_difference": max_difference(straight, resumed), "warned": starts_from_zero}


def keras_file_warns() -> dict:
    """A .keras file written by rank 0 holds rank 0's error memory: loading it says so."""
    model, _ = model_and_optimizer()
    fit(model, 1)
    path = os.path.join(FOLDER, "model.keras")
    if RANK == 0:
        model.save(path)
    hvd.allreduce(tf.constant(0.0), name="keras_file_written")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        keras.models.load_model(path)
    return {"warned": any("error memory" in str(w.message) for w in caught)}


def exchange_restart(restore_on: str) -> dict:
    shapes = [(6, 5), (5,)]
    rng = np.random.default_rng(RANK)
    grads = [[tf.constant(rng.normal(size=s).astype("float32")) for s in shapes] for _ in range(4)]

    def run(exchange, variables, steps):
        return [exchange.updates(g, variables) for g in steps]

    variables = [tf.Variable(tf.zeros(s)) for s in shapes]
    straight = run(th.GradientExchange(tfs.TopK(k=3)), variables, grads)
    exchange = th.GradientExchange(tfs.TopK(k=3))
    run(exchange, variables, grads[:2])
    th.gather_error_memory(exchange)
    path = os.path.join(FOLDER, f"exchange_{restore_on}")
    if RANK == 0:
        tf.train.Checkpoint(exchange=exchange).write(path)
    hvd.allreduce(tf.constant(0.0), name=f"exchange_{restore_on}_written")
    again = th.GradientExchange(tfs.TopK(k=3))
    if restore_on == "every_rank" or RANK == 0:
        tf.train.Checkpoint(exchange=again).read(path)
    again.build(variables)
    if restore_on == "rank0":
        th.scatter_error_memory(again)
        hvd.broadcast_variables([again.step], root_rank=0)
    resumed = run(again, variables, grads[2:])
    difference = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for step_a, step_b in zip(straight[2:], resumed, strict=True)
        for a, b in zip(step_a, step_b, strict=True)
    )
    return {"max_difference": difference, "warned": False}


def main() -> None:
    checks = Checks()
    for restore_on in ("every_rank", "rank0"):
        checks.run(
            f"keras_gathered_{restore_on}",
            lambda r=restore_on: keras_restart(f"keras_{r}", True, r),
        )
        checks.run(f"exchange_gathered_{restore_on}", lambda r=restore_on: exchange_restart(r))
    checks.run("keras_file_warns", keras_file_warns)
    checks.run(
        "keras_rank0_rows_only", lambda: keras_restart("keras_rank0_only", False, "every_rank")
    )
    checks.exit()


if __name__ == "__main__":
    main()
