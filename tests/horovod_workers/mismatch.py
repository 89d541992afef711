"""Ranks configured differently under ``horovodrun -np 2``: a clear error at the first step.

Each case builds something different on rank 1, expects ``InvalidArgumentError`` naming the
field on every rank within seconds, and goes on; the last cases train normally, which shows
Horovod is still in step after the failures. Also: the local ValueErrors of the front ends.
"""

from __future__ import annotations

import os
import tempfile
import time

import keras
import numpy as np
import tensorflow as tf
from common import Checks, hvd

import tf_sparsify as tfs
import tf_sparsify.horovod as th

RANK = hvd.rank()
X = np.random.default_rng(RANK).normal(size=(32, 8)).astype("float32")
Y = np.arange(32) % 3
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MAX_SECONDS = 30


def make_model(dtype: str = "float32") -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, dtype=dtype), keras.layers.Dense(3, dtype=dtype)]
    )


def fit(model, compressor, eager: bool = False, **options) -> keras.Model:
    model.compile(
        optimizer=th.DistributedOptimizer(keras.optimizers.SGD(0.1), compressor, **options),
        loss=LOSS,
        jit_compile=False,
        run_eagerly=eager,
    )
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    return model


def exchange_step(exchange, model, in_function: bool) -> None:
    def step():
        with tf.GradientTape() as tape:
            loss = LOSS(Y, model(X))
        th.DistributedGradientTape(tape, exchange=exchange).gradient(
            loss, model.trainable_variables
        )

    (tf.function(step) if in_function else step)()


def expect_mismatch(field: str, run) -> dict:
    start = time.perf_counter()
    try:
        run()
    except tf.errors.InvalidArgumentError as error:
        seconds = time.perf_counter() - start
        message = str(error)
        if f"differ in their {field}" not in message:
            raise AssertionError(f"error does not name {field!r}: {message[:1500]}") from error
        if seconds > MAX_SECONDS:
            raise AssertionError(f"the error took {seconds:.1f} s") from error
        line = next(s for s in message.splitlines() if "configured differently" in s)
        return {"message": line.strip()[:600], "error_seconds": round(seconds, 2)}
    raise AssertionError("no error although the ranks differ")


def expect_value_error(words: str, run) -> dict:
    try:
        run()
    except ValueError as error:
        if words not in str(error):
            raise AssertionError(f"ValueError without {words!r}: {error}") from error
        return {"message": str(error)[:300]}
    raise AssertionError("no ValueError")


def main() -> None:
    checks = Checks()
    k = 4 + RANK
    other = tfs.TopK(k=4) if RANK == 0 else tfs.RandomK(0.5)
    checks.run("k", lambda: expect_mismatch("compressor", lambda: fit(make_model(), tfs.TopK(k=k))))
    checks.run(
        "compressor", lambda: expect_mismatch("compressor", lambda: fit(make_model(), other))
    )
    checks.run(
        "powersgd_rank",
        lambda: expect_mismatch("compressor", lambda: fit(make_model(), tfs.PowerSGD(1 + RANK))),
    )
    checks.run(
        "dtype",
        lambda: expect_mismatch(
            "variable shapes and dtypes",
            lambda: fit(make_model("float64" if RANK else "float32"), tfs.TopK(k=4)),
        ),
    )
    checks.run(
        "error_feedback",
        lambda: expect_mismatch(
            "pipeline options",
            lambda: fit(make_model(), tfs.TopK(k=4), error_feedback=bool(RANK)),
        ),
    )
    checks.run(
        "late_buckets",
        lambda: expect_mismatch(
            "pipeline options",
            lambda: fit(make_model(), tfs.TopK(k=4), late_buckets="all" if RANK else "none"),
        ),
    )
    checks.run(
        "k_eager",
        lambda: expect_mismatch("compressor", lambda: fit(make_model(), tfs.TopK(k=k), eager=True)),
    )
    checks.run(
        "exchange_k",
        lambda: expect_mismatch(
            "compressor",
            lambda: exchange_step(th.GradientExchange(tfs.TopK(k=k)), make_model(), True),
        ),
    )
    checks.run(
        "exchange_min_size",
        lambda: expect_mismatch(
            "pipeline options",
            lambda: exchange_step(
                th.GradientExchange(tfs.TopK(k=4), min_size=10 * RANK), make_model(), False
            ),
        ),
    )

    def none_gradient(compressor) -> dict:
        """Rank 1 has no gradient for the last bias: named error, not a hang."""
        model = make_model()
        exchange = th.GradientExchange(compressor)
        variables = model.trainable_variables
        with tf.GradientTape() as tape:
            loss = LOSS(Y, model(X))
        grads = tape.gradient(loss, variables)
        if RANK == 1:
            grads[-1] = None
        return expect_mismatch(
            "variables without a gradient", lambda: exchange.updates(grads, variables)
        )

    checks.run("none_gradient_topk", lambda: none_gradient(tfs.TopK(k=2)))
    checks.run("none_gradient_sparse_allreduce", lambda: none_gradient(tfs.SparseAllReduce(k=2)))

    def restored_on_rank0(k: int) -> tuple[keras.Model, th.DistributedOptimizer]:
        """Train, checkpoint on rank 0 (Horovod's idiom), then a new model and optimizer of
        which rank 0 alone restores the checkpoint."""
        folder = hvd.broadcast_object(tempfile.mkdtemp() if RANK == 0 else None)
        model = fit(make_model(), tfs.TopK(k=4))
        if RANK == 0:
            tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(
                os.path.join(folder, "ckpt")
            )
        hvd.allreduce(tf.constant(0.0), name="checkpoint_written")
        model = make_model()
        optimizer = th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=k))
        optimizer.build(model.trainable_variables)
        if RANK == 0:
            status = tf.train.Checkpoint(model=model, optimizer=optimizer).read(
                os.path.join(folder, "ckpt")
            )
            status.assert_existing_objects_matched()
        model.compile(optimizer=optimizer, loss=LOSS, jit_compile=False)
        return model, optimizer

    def restore_then_broadcast() -> dict:
        """Rank 0 restores, BroadcastGlobalVariablesCallback(0), fit: every rank runs the
        plan check (nothing that decides it is checkpointed), so no hang."""
        model, optimizer = restored_on_rank0(4)
        start = time.perf_counter()
        model.fit(
            X,
            Y,
            batch_size=16,
            epochs=1,
            verbose=0,
            callbacks=[th.BroadcastGlobalVariablesCallback(0)],
        )
        seconds = time.perf_counter() - start
        if seconds > MAX_SECONDS:
            raise AssertionError(f"fit after the restore took {seconds:.1f} s")
        weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        gathered = hvd.allgather_object(weights)
        if not np.array_equal(gathered[0], gathered[1]):
            raise AssertionError("the ranks' weights differ after the restore and broadcast")
        return {"fit_seconds": round(seconds, 2), "steps": int(optimizer.iterations.numpy())}

    checks.run("restore_then_broadcast", restore_then_broadcast)

    def restore_then_mismatch() -> dict:
        """After rank 0's restore, ranks configured differently still get the named error."""
        model, _ = restored_on_rank0(k)
        return expect_mismatch(
            "compressor", lambda: model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
        )

    checks.run("restore_then_mismatch", restore_then_mismatch)

    def one_rank_changes(before, after, expect) -> dict:
        """Train, then rank 1 alone calls set_compressor (as a callback on one rank would)."""
        model = fit(make_model(), before)
        if RANK == 1:
            model.optimizer.set_compressor(after)
            model.make_train_function(force=True)
        return expect(lambda: model.fit(X, Y, batch_size=16, epochs=1, verbose=0))

    checks.run(
        "set_compressor_on_one_rank",
        lambda: one_rank_changes(
            tfs.QSGD(4, seed=0), tfs.QSGD(4, seed=1), lambda run: expect_mismatch("compressor", run)
        ),
    )

    def apply_in_flight_on_one_rank(late_buckets: str) -> dict:
        """Both ranks train with late buckets; then rank 0 alone applies what is in flight
        while rank 1 trains on."""
        model = fit(make_model(), tfs.TopK(k=4), late_buckets=late_buckets, bucket_bytes=64)
        if RANK == 0:
            return expect_mismatch("step", model.optimizer.apply_in_flight)
        return expect_mismatch("step", lambda: model.fit(X, Y, batch_size=16, epochs=1, verbose=0))

    checks.run("apply_in_flight_on_one_rank_last", lambda: apply_in_flight_on_one_rank("last"))
    checks.run("apply_in_flight_on_one_rank_all", lambda: apply_in_flight_on_one_rank("all"))
    checks.run(
        "set_compressor_k_on_one_rank",
        lambda: one_rank_changes(
            tfs.TopK(k=4), tfs.TopK(k=6), lambda run: expect_mismatch("compressor", run)
        ),
    )

    def still_in_step() -> dict:
        model = fit(make_model(), tfs.TopK(k=4))
        exchange = th.GradientExchange(tfs.TopK(k=4))
        exchange_step(exchange, model, True)
        exchange_step(exchange, model, True)
        weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        gathered = hvd.allgather_object(weights)
        if not np.array_equal(gathered[0], gathered[1]):
            raise AssertionError("the ranks' weights differ after a matching run")
        return {"exchange_steps": int(exchange.step.numpy())}

    checks.run("matching_ranks_still_train", still_in_step)

    # Local errors, raised before anything travels.
    checks.run(
        "tape_needs_exchange_for_state",
        lambda: expect_value_error(
            "GradientExchange", lambda: th.DistributedGradientTape(tf.GradientTape(), tfs.TopK(k=4))
        ),
    )
    checks.run(
        "tape_randomized_needs_exchange",
        lambda: expect_value_error(
            "GradientExchange",
            lambda: th.DistributedGradientTape(tf.GradientTape(), tfs.RandomK(0.5)),
        ),
    )

    def xla() -> dict:
        model = make_model()
        model.compile(
            optimizer=th.DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.RandomK(0.5)),
            loss=LOSS,
            jit_compile=True,
        )
        return expect_value_error("jit_compile=False", lambda: model.fit(X, Y, verbose=0))

    checks.run("xla_rejected", xla)
    checks.exit()


if __name__ == "__main__":
    main()
