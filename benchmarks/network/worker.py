"""One process of a throughput job, under ``horovodrun`` or as a MultiWorkerMirroredStrategy worker.

Every process builds one model and optimizer per compressor (the same seed, so the same
initial weights on every process), runs ``--warmup`` untimed steps of each (tracing, the
first-step plan check), then ``--rounds`` rounds in which each compressor in turn runs a window
of ``--window`` steps (A B C A B C ...). Each step ends with its loss read back, so a window's
wall time covers every step in it. Each process times every step (from the end of the one
before); after the window, untimed, one all-gather brings every process's step times to each
(:mod:`benchmarks.network.steps`). A window counts the slowest process's time: a synchronous
step waits for that process, and for the ``compute`` probe it is the best pace a synchronous
job of these processes could keep if their per-step jitter lined up. The window's lockstep
floor, the mean over steps of the slowest process's step, is what lockstep steps with that
jitter cost at least. Rank 0 appends one JSON line per window and one per compressor at the
end to ``--results``. The inner optimizer is ``SGD(--lr, momentum=--momentum)``.

- horovod: ``tf_sparsify.horovod.DistributedOptimizer`` compiled into the model
  (``jit_compile=False``); a step is ``model.train_on_batch`` (Keras' compiled train function).
- horovod probes (for the overlap check: a TopK 1% step against the larger of its halves):
  ``compute`` trains with a local Keras SGD and no exchange at all; ``compute_sync`` does the
  same and then all-reduces one float, so its ranks run in lockstep as every synchronous step
  does (each waits for the slower one); ``exchange_topk1``, ``exchange_identity`` and
  ``exchange_fp16`` only move payloads of their compressor's shapes and wire dtype through the
  same collective (one all-gather per bucket for TopK, one all-reduce per bucket for dense).
- mwms: ``model.fit`` with ``tf_sparsify.SparsifiedOptimizer`` compiled into a model made
  under ``MultiWorkerMirroredStrategy`` (one ``fit`` call of ``--window`` steps per window, on a
  dataset whose global batch, ``--batch`` rows per worker, is sharded over the workers; a
  window is timed from its first step's start to its last step's end, as a callback sees them,
  without the call's set-up).
- mwms probes: ``compute`` fits a local model with a local Keras SGD (no exchange);
  ``loop_topk1`` is TopK 1% in a custom loop (``strategy.run`` + ``apply_gradients``), the
  way to train before ``fit`` ran under this strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.network.affinity import pin_to_rank_cores  # noqa: E402

pin_to_rank_cores()  # before TensorFlow starts its thread pools

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sparsify as tfs  # noqa: E402
from benchmarks.network.auto_steps import auto_for, auto_summary, driven_auto_for  # noqa: E402
from benchmarks.network.models import (  # noqa: E402
    EXCHANGE_ONLY,
    exchange_setup,
    make_model,
    synthetic_batch,
)
from benchmarks.network.steps import lockstep_floor, slowest_pace  # noqa: E402

SEED = 0


#: this process's step seconds of a window -> every process's, ``[ranks, steps]``
Gather = Callable[[list[float]], np.ndarray]


@dataclass
class Trainer:
    """One compressor's model and optimizer; ``run(n)`` trains ``n`` steps to completion and
    returns each step's seconds (from the end of the one before; the first from the window's
    start), which sum to the window's."""

    compressor: str
    run: Callable[[int], list[float]]
    optimizer: tfs.SparsifiedOptimizer
    #: the callback choosing Auto's settings (``auto`` only)
    auto: tfs.AutoCompression | None = None


def one_by_one(step: Callable[[], float]) -> Callable[[int], list[float]]:
    """``run(n)`` from a callable that trains one step and reads its result back."""

    def run(steps: int) -> list[float]:
        ends = [time.perf_counter()]
        for _ in range(steps):
            step()
            ends.append(time.perf_counter())
        return np.diff(ends).tolist()

    return run


class StepClock(keras.callbacks.Callback):
    """A ``fit`` call's step seconds, from its first step's start to its last step's end (the
    steps, without the call's own set-up: its dataset iterator and callbacks). Overriding
    ``on_train_batch_end`` makes Keras call it in step, with each step's logs read back."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.ends = [time.perf_counter()]

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        return np.diff(self.ends).tolist()


def sgd(args: argparse.Namespace) -> keras.optimizers.SGD:
    """The inner optimizer: ``SGD(--lr, momentum=--momentum)``."""
    return keras.optimizers.SGD(args.lr, momentum=args.momentum)


def loss_fn() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def horovod_trainers(args: argparse.Namespace) -> tuple[int, int, list[Trainer], Gather]:
    """``(rank, size, trainers, gather)`` under ``horovodrun``."""
    import horovod.tensorflow as hvd

    import tf_sparsify.horovod as th
    from benchmarks.horovodrun import require_gloo

    require_gloo()
    hvd.init()
    x, y = synthetic_batch(args.model, args.image_size, args.batch, seed=1 + hvd.rank())
    trainers = []
    for name in args.compressors.split(","):
        model = make_model(args.model, args.image_size, SEED)
        compressor, options = exchange_setup(name, args.bucket_bytes)
        optimizer = th.DistributedOptimizer(sgd(args), compressor, **options)
        if name in EXCHANGE_ONLY:
            optimizer.build(model.trainable_variables)
            trainers.append(Trainer(name, one_by_one(exchange_only(optimizer)), optimizer))
            continue
        local = name in ("compute", "compute_sync")
        if local:  # trains locally; the unused exchange optimizer only counts 0
            optimizer.build(model.trainable_variables)
        inner = sgd(args) if local else optimizer
        model.compile(inner, loss_fn(), jit_compile=False)  # Horovod's ops are not XLA ops
        auto = driven_auto_for(compressor, model, args.auto_interval)  # the steps call it

        def step(
            model: keras.Model = model, sync: bool = name == "compute_sync", auto=auto
        ) -> float:
            loss = float(model.train_on_batch(x, y))
            if sync:
                hvd.allreduce(tf.zeros([]), name="lockstep")
            if auto is not None:
                auto.on_train_batch_end(0)
            return loss

        trainers.append(Trainer(name, one_by_one(step), optimizer, auto))

    def gather(seconds: list[float]) -> np.ndarray:
        mine = tf.constant([seconds], tf.float32)
        return hvd.allgather(mine, name="step_seconds").numpy()

    return hvd.rank(), hvd.size(), trainers, gather


def unit_payload(unit, rng: np.random.Generator) -> list[tf.Variable]:
    """A unit's wire tensors, drawn once: a summable compressor's dense values in its wire
    dtype (float32 unless it casts), else the values and indices of its ``k`` entries."""
    compressor, n = unit.compressor, unit.num_elements
    if compressor.summable:
        dtype = getattr(compressor, "wire_dtype", tf.float32)
        values = tf.cast(rng.standard_normal(n, dtype=np.float32), dtype)
        return [tf.Variable(values, trainable=False)]
    k = compressor.entries_sent(n)
    return [
        tf.Variable(rng.standard_normal(k, dtype=np.float32), trainable=False),
        tf.Variable(rng.integers(0, n, k, dtype=np.int32), trainable=False),
    ]


def exchange_only(optimizer) -> Callable[[], float]:
    """A step that only moves payloads of the optimizer's plan (:func:`unit_payload`, one
    all-reduce or all-gather per bucket, as the pipeline does) through its collective, and
    counts them in ``bytes_sent``. The payloads are drawn once, before any step, so a step
    costs the exchange and nothing else."""
    rng = np.random.default_rng(SEED)
    payloads: dict[int, list[tf.Variable]] = {}
    for unit in optimizer.units:
        payloads.setdefault(unit.bucket, []).extend(unit_payload(unit, rng))
    summable = {unit.bucket: unit.compressor.summable for unit in optimizer.units}

    @tf.function
    def move() -> tf.Tensor:
        collective = optimizer.collective()
        total = tf.constant(0.0)
        for bucket in sorted(payloads):
            tensors = [v.read_value() for v in payloads[bucket]]
            if summable[bucket]:
                moved = [t[:1] for t in collective.all_reduce_sum(tensors)]
            else:
                moved = [g[:, :1] for g in collective.all_gather(tensors)]
            total += tf.add_n([tf.reduce_sum(tf.cast(m, tf.float32)) for m in moved])
        optimizer.bytes_sent.assign_add(optimizer.wire_bytes_per_step)
        optimizer.exchange_steps.assign_add(1)
        return total

    return lambda: float(move())


def mwms_trainers(args: argparse.Namespace) -> tuple[int, int, list[Trainer], Gather]:
    """``(rank, size, trainers, gather)`` in a worker started with a ``TF_CONFIG``."""
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    rank, size = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    batches = [synthetic_batch(args.model, args.image_size, args.batch, 1 + r) for r in range(size)]
    # every worker builds the global batch; fit shards it, worker r gets rows of batch r
    x, y = (tf.constant(np.concatenate(parts)) for parts in zip(*batches, strict=True))
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    trainers = []
    for name in args.compressors.split(","):
        compressor, options = exchange_setup(name, args.bucket_bytes)
        with strategy.scope():
            model = make_model(args.model, args.image_size, SEED)
            optimizer = tfs.SparsifiedOptimizer(sgd(args), compressor, **options)
        if name == "loop_topk1":
            local = tf.constant(batches[rank][0]), tf.constant(batches[rank][1])
            run = one_by_one(loop_step(strategy, model, optimizer, *local))
        elif name == "compute":
            with strategy.scope():
                optimizer.build(model.trainable_variables)  # unused: its counters read 0
            local_model = make_model(args.model, args.image_size, SEED)
            local_model.compile(sgd(args), loss_fn())
            local_data = tf.data.Dataset.from_tensors(batches[rank]).repeat()
            run = fit_steps(local_model, local_data)
        else:
            with strategy.scope():
                model.compile(optimizer, loss_fn())
            auto = auto_for(compressor, model, args.auto_interval)
            run = fit_steps(model, dataset, [] if auto is None else [auto])
        trainers.append(Trainer(name, run, optimizer, auto))

    def gather(seconds: list[float]) -> np.ndarray:
        def all_gather(t: tf.Tensor) -> tf.Tensor:
            return tf.distribute.get_replica_context().all_gather(t[None], axis=0)

        each = strategy.run(all_gather, args=(tf.constant(seconds, tf.float32),))
        return strategy.experimental_local_results(each)[0].numpy()

    return rank, size, trainers, gather


def fit_steps(
    model: keras.Model, dataset: tf.data.Dataset, callbacks: list | None = None
) -> Callable[[int], list[float]]:
    """``run(n)``: one ``model.fit`` call of ``n`` steps, timed from its first step's start to
    its last step's end (a ``fit`` call's set-up is paid once per call, not per step), with
    ``callbacks`` besides the clock."""
    clock = StepClock()

    def run(steps: int) -> list[float]:
        every = [clock, *(callbacks or [])]
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=every)
        return clock.step_seconds()

    return run


def loop_step(strategy, model, optimizer, x, y) -> Callable[[], float]:
    """One synchronous custom-loop step under ``strategy``, returning the loss."""
    loss_of = loss_fn()
    variables = model.trainable_variables
    with strategy.scope():
        optimizer.build(variables)

    def replica_step():
        with tf.GradientTape() as tape:
            # Each replica's mean loss over the replica count, as Keras scales it.
            loss = loss_of(y, model(x, training=True)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss

    train = tf.function(lambda: strategy.run(replica_step))

    def step() -> float:
        return float(strategy.experimental_local_results(train())[0])

    return step


@dataclass
class Windows:
    """One compressor's timed windows: the slowest process's ms/step and the lockstep floor's
    ms/step, a value per window."""

    step_ms: list[float] = field(default_factory=list)
    floor_ms: list[float] = field(default_factory=list)


def timed_rounds(
    trainers: list[Trainer],
    gather: Gather,
    args: argparse.Namespace,
    emit: Callable[[dict], None],
) -> dict[str, Windows]:
    """Warm every trainer up, then interleave timed windows; their ms/step by compressor."""
    for trainer in trainers:
        trainer.run(args.warmup)
    windows = {t.compressor: Windows() for t in trainers}
    for round_index in range(args.rounds):
        for trainer in trainers:
            step_times = gather(trainer.run(args.window))
            ms, floor_ms = 1e3 * slowest_pace(step_times), 1e3 * lockstep_floor(step_times)
            windows[trainer.compressor].step_ms.append(ms)
            windows[trainer.compressor].floor_ms.append(floor_ms)
            emit(
                {
                    "event": "window",
                    "round": round_index + 1,
                    "compressor": trainer.compressor,
                    "ms_per_step": ms,
                    "floor_ms_per_step": floor_ms,
                }
            )
    return windows


def summary(trainer: Trainer, windows: Windows) -> dict[str, Any]:
    """The result record of one compressor: best and median window, the best window's lockstep
    floor (never below the best window: each window's floor is at least its ms/step), bytes
    per step and rank."""
    steps = int(trainer.optimizer.exchange_steps.numpy())
    return {
        "event": "result",
        "compressor": trainer.compressor,
        "best_ms": min(windows.step_ms),
        "median_ms": statistics.median(windows.step_ms),
        "windows_ms": windows.step_ms,
        "floor_ms": min(windows.floor_ms),
        "floor_windows_ms": windows.floor_ms,
        "steps": steps,
        "bytes_per_step": int(trainer.optimizer.bytes_sent.numpy()) // max(steps, 1),
        **({} if trainer.auto is None else auto_summary(trainer.auto)),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("horovod", "mwms"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--compressors", required=True, help="comma list of benchmark names")
    p.add_argument("--rate", required=True, help="the link's rate, recorded with each result")
    p.add_argument("--results", required=True, help="JSON-lines file rank 0 appends to")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.0, help="the inner SGD's momentum")
    p.add_argument("--bucket-bytes", type=int, default=None, help="the exchange's bucket_bytes")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--auto-interval", type=int, default=20, help="steps between Auto's decisions")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--window", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TF's default)")
    p.add_argument("--timeout", type=int, default=300, help="collective timeout, seconds (mwms)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    make = horovod_trainers if args.backend == "horovod" else mwms_trainers
    rank, size, trainers, gather = make(args)
    context = {
        "backend": args.backend,
        "model": args.model,
        "rate": args.rate,
        "ranks": size,
        "batch": args.batch,
        "momentum": args.momentum,
    }

    def emit(record: dict) -> None:
        if rank == 0:
            with open(args.results, "a") as f:
                f.write(json.dumps({**context, **record}) + "\n")

    windows = timed_rounds(trainers, gather, args, emit)
    for trainer in trainers:
        emit(summary(trainer, windows[trainer.compressor]))


if __name__ == "__main__":
    main()
