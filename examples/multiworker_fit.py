"""``model.fit`` across machines: MultiWorkerMirroredStrategy with a compressed optimizer.

    python examples/multiworker_fit.py                   # 2 local workers, TopK 1% + EF
    python examples/multiworker_fit.py --workers 3 --compressor qsgd --epochs 10

The launcher starts the workers as processes on this machine (free ports, a ``TF_CONFIG``
each, see :func:`tf_sparsify.distribute.run_local_workers`); on real machines start the same
script on each with its own ``TF_CONFIG`` and ``--worker``. Every worker runs the script a
Keras user writes for one machine, inside ``MultiWorkerMirroredStrategy.scope()``:
``compile`` with a :class:`tf_sparsify.SparsifiedOptimizer`, ``fit`` on a ``tf.data.Dataset``
of global batches (sharded over the workers), with ``keras.callbacks.BackupAndRestore`` (kill a
worker, start them all again: training resumes from the newest epoch every worker backed up,
each worker with its own residuals), then ``evaluate``. Data: scikit-learn's bundled
breast-cancer set, standardized.
The launcher checks that the workers end with identical weights and prints their history.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

# TensorFlow's C++ log lines off unless the user asked for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

COMPRESSORS = ("topk", "qsgd", "identity")
GLOBAL_BATCH = 64


def make_compressor(name: str):
    import tf_sparsify as tfs

    return {"topk": tfs.TopK(ratio=0.01), "qsgd": tfs.QSGD(levels=4), "identity": tfs.Identity()}[
        name
    ]


def train(args: argparse.Namespace) -> None:
    """One worker: what a Keras user writes, under MultiWorkerMirroredStrategy."""
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_breast_cancer

    import tf_sparsify as tfs

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = load_breast_cancer(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype("float32")
    y = y.astype("float32")[:, None]
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)

    keras.utils.set_random_seed(0)  # the same initial weights on every worker
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((30,)),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(1, activation="sigmoid"),
            ]
        )
        optimizer = tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.9), make_compressor(args.compressor)
        )
        model.compile(optimizer, loss="binary_crossentropy", metrics=["accuracy"])
    backup = keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"))
    history = model.fit(dataset, epochs=args.epochs, callbacks=[backup], verbose=0)
    loss, accuracy = model.evaluate(dataset, verbose=0)

    worker = strategy.cluster_resolver.task_id
    np.savez(os.path.join(args.out, f"weights{worker}.npz"), *model.get_weights())
    with open(os.path.join(args.out, f"history{worker}.json"), "w") as f:
        record = {"history": history.history, "loss": loss, "accuracy": accuracy}
        json.dump({**record, "bytes_per_step": optimizer.wire_bytes_per_step}, f)


def launch(args: argparse.Namespace) -> list[dict]:
    """Start the workers on this machine; return each one's record (history, evaluation)."""
    import numpy as np

    from tf_sparsify.distribute import run_local_workers

    worker_args = [
        os.path.abspath(__file__),
        "--worker",
        f"--out={args.out}",
        f"--compressor={args.compressor}",
        f"--epochs={args.epochs}",
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    run_local_workers(worker_args, args.workers, timeout=600, env={"PYTHONPATH": path})
    records = []
    for i in range(args.workers):
        with open(os.path.join(args.out, f"history{i}.json")) as f:
            records.append(json.load(f))
        with np.load(os.path.join(args.out, f"weights{i}.npz")) as data:
            records[-1]["weights"] = [data[k] for k in data.files]
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--compressor", choices=COMPRESSORS, default="topk")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--out", default=None, help="folder for results (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help="run as one worker (TF_CONFIG set)")
    args = p.parse_args(argv)
    if args.worker:
        train(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        args.out = args.out or tmp
        records = launch(args)
    first = records[0]
    identical = all(
        all((a == b).all() for a, b in zip(first["weights"], r["weights"], strict=True))
        for r in records[1:]
    )
    print(f"{args.workers} workers, {args.compressor}, {first['bytes_per_step']:,} bytes/step")
    history = first["history"]
    for epoch, (loss, acc) in enumerate(zip(history["loss"], history["accuracy"], strict=True), 1):
        print(f"epoch {epoch}: loss {loss:.4f}  accuracy {acc:.4f}")
    print(f"evaluate: loss {first['loss']:.4f}  accuracy {first['accuracy']:.4f}")
    print("all workers identical" if identical else "WORKERS DIFFER")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
