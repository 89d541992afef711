"""One rank of the time-to-accuracy job, under ``horovodrun``.

Digits from scikit-learn (bundled, no download), an equal shard of the training split per rank,
a wide MLP 64->1024->1024->10 with ``tf_sparsify.horovod.DistributedOptimizer`` (plain SGD:
with momentum 0.9 TopK + EF oscillated here) per compressor. The compressors take turns epoch
by epoch (A B C A B C ...); each has its own clock that runs only during its own training
steps. After each epoch every rank evaluates on the whole test split (untimed) and rank 0
appends ``(epoch, seconds, accuracy)`` to ``--results`` (epoch 0: before training); at the end,
one line per compressor with its bytes per step and rank. The first epoch's time includes
tracing the train function.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.network.affinity import pin_to_rank_cores  # noqa: E402

pin_to_rank_cores()  # before TensorFlow starts its thread pools

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_sparsify.horovod as th  # noqa: E402
from benchmarks.network.models import make_compressor, mlp  # noqa: E402

SEED = 0
WIDTHS = (1024, 1024)


def load_shard(rank: int, size: int) -> tuple[np.ndarray, ...]:
    """This rank's training shard (all shards the same length) and the whole test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    per_rank = len(x_tr) // size
    rows = np.random.default_rng(SEED).permutation(len(x_tr))[rank * per_rank :][:per_rank]
    return x_tr[rows], y_tr[rows], x_te, y_te


def make_trainee(name: str, lr: float) -> keras.Model:
    """The wide MLP compiled with ``name``'s compressor (same initial weights on every rank)."""
    keras.utils.set_random_seed(SEED)
    model = mlp(64, WIDTHS)
    optimizer = th.DistributedOptimizer(keras.optimizers.SGD(lr), make_compressor(name))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer, loss, jit_compile=False)  # Horovod's ops are not XLA ops
    return model


def train_epoch(model: keras.Model, x: np.ndarray, y: np.ndarray, batch: int, seed: int) -> float:
    """One shuffled pass over this rank's shard; its wall-clock seconds."""
    order = np.random.default_rng(seed).permutation(len(x))
    start = time.perf_counter()
    for first in range(0, len(x) - batch + 1, batch):
        rows = order[first : first + batch]
        model.train_on_batch(x[rows], y[rows])
    return time.perf_counter() - start


def accuracy_on(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(model.predict_on_batch(x), axis=1) == y))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compressors", required=True, help="comma list of benchmark names")
    p.add_argument("--rate", required=True, help="the link's rate, recorded with each result")
    p.add_argument("--results", required=True, help="JSON-lines file rank 0 appends to")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="plain SGD")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hvd.init()
    x_tr, y_tr, x_te, y_te = load_shard(hvd.rank(), hvd.size())
    names = args.compressors.split(",")
    models = {name: make_trainee(name, args.lr) for name in names}
    clocks = dict.fromkeys(names, 0.0)

    def emit(record: dict) -> None:
        if hvd.rank() == 0:
            with open(args.results, "a") as f:
                context = {"rate": args.rate, "ranks": hvd.size()}
                f.write(json.dumps({**context, **record}) + "\n")

    for epoch in range(args.epochs + 1):  # epoch 0: the initial weights
        for name, model in models.items():
            if epoch:
                seed = epoch * 1000 + hvd.rank()
                clocks[name] += train_epoch(model, x_tr, y_tr, args.batch, seed)
            accuracy = accuracy_on(model, x_te, y_te)
            emit(
                {
                    "event": "epoch",
                    "compressor": name,
                    "epoch": epoch,
                    "seconds": clocks[name],
                    "accuracy": accuracy,
                }
            )
    for name, model in models.items():
        steps = int(model.optimizer.iterations.numpy())
        sent = int(model.optimizer.bytes_sent.numpy())
        emit(
            {"event": "result", "compressor": name, "steps": steps, "bytes_per_step": sent // steps}
        )


if __name__ == "__main__":
    main()
