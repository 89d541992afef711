"""One rank of the time-to-target job, under ``horovodrun``.

Trains one task of :data:`benchmarks.network.tasks.TASKS` (``--task``: its model, data and
score) with ``tf_sparsify.horovod.DistributedOptimizer`` around the task's inner optimizer, one
model per compressor, all from the same initial weights. The compressors take turns epoch by
epoch (A B C A B C ...); each has its own clock that runs only during its own training steps.
After each epoch every rank scores its model on the task's evaluation data (untimed) and rank 0
appends ``(epoch, step, seconds, score)`` to ``--results`` (epoch 0: before training); at the
end, one line per compressor with its bytes per step and rank. The first epoch's time includes
tracing the train function. ``auto``'s clock also counts its link probes and decisions (every
``--auto-interval`` of its steps), and its records say what it chose.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.network.affinity import pin_to_rank_cores  # noqa: E402

pin_to_rank_cores()  # before TensorFlow starts its thread pools

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402

import tf_sparsify as tfs  # noqa: E402
import tf_sparsify.horovod as th  # noqa: E402
from benchmarks.horovodrun import require_gloo  # noqa: E402
from benchmarks.network.auto_steps import auto_summary, driven_auto_for  # noqa: E402
from benchmarks.network.models import exchange_setup  # noqa: E402
from benchmarks.network.tasks import TASKS, Batch, Task  # noqa: E402


@dataclass
class Trainee:
    """One compressor's model and, for ``auto``, the callback choosing its settings."""

    model: keras.Model
    auto: tfs.AutoCompression | None

    def train_epoch(self, batches: list[Batch]) -> float:
        """One step per batch; their wall-clock seconds (Auto's decisions included)."""
        start = time.perf_counter()
        if self.auto is not None:
            self.auto.on_epoch_begin(0)  # the time since its last step was no step
        for x, y in batches:
            self.model.train_on_batch(x, y)
            if self.auto is not None:
                self.auto.on_train_batch_end(0)
        return time.perf_counter() - start

    def summary(self) -> dict:
        """Auto's last decision (nothing for a fixed compressor)."""
        return {} if self.auto is None else auto_summary(self.auto)


def make_trainee(task: Task, name: str, lr: float, auto_interval: int) -> Trainee:
    """The task's model compiled with ``name``'s compressor around its inner optimizer."""
    model = task.model()
    compressor, options = exchange_setup(name)
    optimizer = th.DistributedOptimizer(task.optimizer(lr), compressor, **options)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer, loss, jit_compile=False)  # Horovod's ops are not XLA ops
    return Trainee(model, driven_auto_for(compressor, model, auto_interval))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", required=True, choices=tuple(TASKS))
    p.add_argument("--compressors", required=True, help="comma list of benchmark names")
    p.add_argument("--rate", required=True, help="the link's rate, recorded with each result")
    p.add_argument("--results", required=True, help="JSON-lines file rank 0 appends to")
    p.add_argument("--epochs", type=int, help="default: the task's")
    p.add_argument("--batch", type=int, help="per rank; default: the task's")
    p.add_argument("--lr", type=float, help="the inner optimizer's; default: the task's")
    p.add_argument("--auto-interval", type=int, default=20, help="steps between Auto's decisions")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    task = TASKS[args.task]
    epochs, batch, lr = args.epochs or task.epochs, args.batch or task.batch, args.lr or task.lr
    require_gloo()
    hvd.init()
    names = args.compressors.split(",")
    trainees = {name: make_trainee(task, name, lr, args.auto_interval) for name in names}
    clocks = dict.fromkeys(names, 0.0)
    evaluation = task.evaluation()

    def emit(record: dict) -> None:
        if hvd.rank() == 0:
            with open(args.results, "a") as f:
                context = {"task": args.task, "rate": args.rate, "ranks": hvd.size()}
                f.write(json.dumps({**context, **record}) + "\n")

    for epoch in range(epochs + 1):  # epoch 0: the initial weights
        # the same batches for every compressor, made before any clock starts
        batches = list(task.epoch(hvd.rank(), hvd.size(), epoch, batch)) if epoch else []
        for name, trainee in trainees.items():
            if epoch:
                clocks[name] += trainee.train_epoch(batches)
            emit(
                {
                    "event": "epoch",
                    "compressor": name,
                    "epoch": epoch,
                    "step": int(trainee.model.optimizer.iterations.numpy()),
                    "seconds": clocks[name],
                    "score": task.score(trainee.model, evaluation),
                    **trainee.summary(),
                }
            )
    for name, trainee in trainees.items():
        optimizer = trainee.model.optimizer
        steps = int(optimizer.iterations.numpy())
        sent = int(optimizer.bytes_sent.numpy())
        result = {"compressor": name, "steps": steps, "bytes_per_step": sent // steps}
        emit({"event": "result", **result, **trainee.summary()})


if __name__ == "__main__":
    main()
