"""Keras ``model.fit`` under Horovod with a compressed, sparse gradient exchange.

Each rank trains on its own shard of scikit-learn's bundled digits (no download); the
gradients travel through ``tf_sparsify.horovod.DistributedOptimizer`` (TopK 1% + error
feedback by default: values and indices by all-gather). Rank 0 prints the test accuracy and
the bytes one rank hands to Horovod per step.

    horovodrun -np 2 --gloo python examples/horovod_keras_digits.py --epochs 20
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_sparsify as tfs  # noqa: E402
import tf_sparsify.horovod as th  # noqa: E402

COMPRESSORS = {
    "dense": lambda: tfs.Identity(),
    "topk1": lambda: tfs.TopK(ratio=0.01),
    "topk0.1": lambda: tfs.TopK(ratio=0.001),
    "qsgd4": lambda: tfs.QSGD(levels=4, bucket_size=512),
    "fp16": lambda: tfs.FP16(),
}


def parse_args(argv: list[str] | None = None, doc: str = __doc__) -> argparse.Namespace:
    """The options both Horovod examples take; ``doc``'s first line is the description."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--compressor", default="topk1", choices=sorted(COMPRESSORS))
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_shard(rank: int, size: int):
    """This rank's training shard (every shard the same length: ranks must take equal
    numbers of steps, or the last collectives wait forever) and the whole test split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    per_rank = len(x_tr) // size
    order = np.random.default_rng(0).permutation(len(x_tr))[rank * per_rank : (rank + 1) * per_rank]
    return x_tr[order], y_tr[order], x_te, y_te


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    hvd.init()
    x_tr, y_tr, x_te, y_te = load_shard(hvd.rank(), hvd.size())
    # Different initial weights per rank on purpose: the broadcast callback makes them equal.
    model = make_model(args.seed + hvd.rank())
    optimizer = th.DistributedOptimizer(
        keras.optimizers.SGD(args.lr, momentum=0.9), COMPRESSORS[args.compressor]()
    )
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # Horovod's ops do not run under XLA
    )
    th.log0(f"{hvd.size()} ranks x {len(x_tr)} examples, compressor {optimizer.compressor}")
    start = time.perf_counter()
    model.fit(
        x_tr,
        y_tr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        verbose=th.verbose0(2),
        callbacks=[
            th.BroadcastGlobalVariablesCallback(root_rank=0),
            th.MetricAverageCallback(),
            tfs.CompressionStats(),
        ],
    )
    wall = time.perf_counter() - start
    _, accuracy = model.evaluate(x_te, y_te, verbose=0)
    steps = int(optimizer.iterations.numpy())
    return report(
        args.compressor,
        float(accuracy),
        steps,
        int(optimizer.bytes_to_horovod.numpy()),
        optimizer.wire_bytes_per_step,
        optimizer.dense_bytes_per_step,
        wall,
    )


def report(compressor, accuracy, steps, bytes_total, wire_per_step, dense_per_step, wall) -> dict:
    """Print rank 0's accuracy and bytes per step (and a JSON line for tests); return them."""
    result = {
        "compressor": compressor,
        "accuracy": accuracy,
        "steps": steps,
        "bytes_per_step": bytes_total // max(steps, 1),
        "wire_bytes_per_step": wire_per_step,
        "dense_bytes_per_step": dense_per_step,
        "wall_s": round(wall, 1),
    }
    ratio = dense_per_step / max(result["bytes_per_step"], 1)
    th.log0(
        f"rank-0 test accuracy {accuracy:.4f} | bytes/step per rank to Horovod "
        f"{result['bytes_per_step']:,} (dense {dense_per_step:,}, "
        f"{ratio:.1f}x less) | {steps} steps in {wall:.1f} s"
    )
    th.log0("RESULT " + json.dumps(result))
    return result


if __name__ == "__main__":
    main()
