"""Restarts under ``horovodrun -np 2``: one checkpoint written by rank 0 holds every rank's error
memory (after ``gather_error_memory``), and restore-then-continue equals not stopping, bit for
bit, for the Keras front end and ``GradientExchange``, restored on every rank or on rank 0 with a
broadcast; with ``late_buckets`` the checkpoint is written inside ``fit`` with each rank's own
gradient in flight, which is restored per rank as well. Without the gather, a rank whose rows
are missing is warned, not silently fed rank 0's residuals. Each check reports the max weight
difference against an uninterrupted run.
"""

from __future__ import annotations

import functools
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


def model_and_optimizer(late_buckets: str = "none") -> tuple[keras.Model, th.DistributedOptimizer]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(6), keras.layers.Dense(1)])
    optimizer = th.DistributedOptimizer(
        keras.optimizers.SGD(0.05, momentum=0.9), tfs.TopK(ratio=0.2), late_buckets=late_buckets
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


class SaveInFlight(keras.callbacks.Callback):
    """At the end of the first epoch (inside ``fit``, so before its end applies what is in
    flight): gather every rank's rows, rank 0 writes the checkpoint, and this rank's in-flight
    gradients are kept."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path
        self.in_flight: list[np.ndarray] = []

    def on_epoch_end(self, epoch, logs=None):
        if epoch != 0:
            return
        optimizer = self.model.optimizer
        th.gather_error_memory(optimizer)
        self.in_flight = [v.numpy() for v in optimizer.in_flight if v is not None]
        if RANK == 0:
            tf.train.Checkpoint(model=self.model, optimizer=optimizer).write(self.path)
        hvd.allreduce(tf.constant(0.0), name="keras_late_written")


@functools.cache
def late_straight() -> tuple[keras.Model, SaveInFlight]:
    """Two epochs of ``fit`` with ``late_buckets="last"`` (one bucket: every variable is late),
    a checkpoint written by rank 0 after the first with every rank's gradient in flight."""
    model, _ = model_and_optimizer("last")
    save = SaveInFlight(os.path.join(FOLDER, "keras_late"))
    fit(model, 2, [save])
    np.savez(os.path.join(FOLDER, f"keras_late_straight_{RANK}.npz"), *model.get_weights())
    return model, save


def keras_late_restart(restore_on: str) -> dict:
    """The uninterrupted run against fresh objects restored from its mid-``fit`` checkpoint
    (on every rank, or on rank 0 then broadcast) and trained one more epoch."""
    straight, save = late_straight()
    resumed, optimizer = model_and_optimizer("last")
    if restore_on == "every_rank" or RANK == 0:
        tf.train.Checkpoint(model=resumed, optimizer=optimizer).read(save.path).assert_consumed()
    callbacks = [th.BroadcastGlobalVariablesCallback(0)] if restore_on == "rank0" else []
    fit(resumed, 1, callbacks)
    # what rank 1 saved in flight, seen on every rank (the test asserts the ranks' differ)
    saved = [
        hvd.broadcast(tf.constant(a), 1, name=f"late_{restore_on}_{i}").numpy()
        for i, a in enumerate(save.in_flight)
    ]
    return {
        "max_difference": max_difference(straight, resumed),
        "in_flight_variables": len(save.in_flight),
        "in_flight_saved": float(sum(np.abs(a).sum() for a in save.in_flight)),
        "same_in_flight_as_rank1": all(
            np.array_equal(a, b) for a, b in zip(save.in_flight, saved, strict=True)
        ),
        "iterations": int(optimizer.iterations.numpy()),
        "folder": FOLDER,  # the checkpoint and the straight run's weights, for late_resume.py
    }


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


def broadcast_keeps_in_flight() -> dict:
    """``BroadcastGlobalVariablesCallback`` gives every rank rank 0's weights but leaves each
    rank's gradients in flight its own (rank 0's would count its gradient twice)."""
    model, optimizer = model_and_optimizer("last")
    for v in optimizer.in_flight:
        v.assign(tf.fill(v.shape, float(RANK + 1)))
    callback = th.BroadcastGlobalVariablesCallback(0)
    callback.set_model(model)
    callback.on_train_begin()
    kept = all(np.all(v.numpy() == RANK + 1) for v in optimizer.in_flight)
    weights = [
        hvd.broadcast(w, 0, name=f"in_flight_weights_{i}") for i, w in enumerate(model.weights)
    ]
    same = all(
        np.array_equal(w.numpy(), b.numpy()) for w, b in zip(model.weights, weights, strict=True)
    )
    return {"in_flight_kept": kept, "weights_from_rank0": same}


def main() -> None:
    checks = Checks()
    checks.run("broadcast_keeps_in_flight", broadcast_keeps_in_flight)
    for restore_on in ("every_rank", "rank0"):
        checks.run(
            f"keras_gathered_{restore_on}",
            lambda r=restore_on: keras_restart(f"keras_{r}", True, r),
        )
        checks.run(f"exchange_gathered_{restore_on}", lambda r=restore_on: exchange_restart(r))
        checks.run(f"keras_late_{restore_on}", lambda r=restore_on: keras_late_restart(r))
    checks.run("keras_file_warns", keras_file_warns)
    checks.run(
        "keras_rank0_rows_only", lambda: keras_restart("keras_rank0_only", False, "every_rank")
    )
    checks.exit()


if __name__ == "__main__":
    main()
