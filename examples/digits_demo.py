"""Main job: train one Keras model on 2 simulated replicas with several compressors.

Data: scikit-learn's bundled digits (no download), or ``--data PATH`` to a local MNIST
``.npz`` (keys ``x_train, y_train, x_test, y_test``). Replicas: MirroredStrategy over logical
CPU devices. Prints a table (test accuracy, bytes per step, compression ratio, wall time) and
writes a PNG of test accuracy against cumulative bytes sent.

    python examples/digits_demo.py --epochs 20 --replicas 2 --compressors dense,topk1,qsgd4
    python examples/digits_demo.py --seeds 5   # mean and spread of the accuracy over 5 seeds

On one machine a run repeats exactly. Another CPU can round differently (TensorFlow's oneDNN
kernels are chosen by instruction set: with ``ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 machine,
TopK 0.1% bfloat16 ends at 0.9756 instead of 0.9822), the runs drift apart, and the accuracy
moves by about its spread over seeds, which ``--seeds`` measures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import time

#: TensorFlow's C++ info and warning lines (``I0000 00:00:...] ...``, the second line of its
#: CPU-feature notice) and absl's preamble
_CPP_LOG_LINE = re.compile(
    r"^[IW]\d{4} \d\d:\d\d|^To enable the following instructions:|^WARNING: All log messages"
)


@contextlib.contextmanager
def _quiet_tensorflow_import():
    """Unless the user set ``TF_CPP_MIN_LOG_LEVEL``: hide TensorFlow's C++ info and warning
    lines while it loads (on some CPUs it prints them before reading that setting), pass on
    anything else it writes, and keep its later C++ logging at warnings and above off."""
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            sys.stderr.write("".join(line for line in log if not _CPP_LOG_LINE.match(line)))


with _quiet_tensorflow_import():
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_sparsify as tfs

# name -> (label, compressor factory, learning-rate factor). Scaled random-k has variance
# beta = d/k - 1 = 9 at 10%; at the dense step size it diverges, so it runs at lr / (1 + beta).
COMPRESSORS = {
    "dense": ("dense (Keras all-reduce)", None, 1.0),
    "topk1": ("TopK 1% + EF", lambda: tfs.TopK(ratio=0.01), 1.0),
    "topk0.1": ("TopK 0.1% + EF", lambda: tfs.TopK(ratio=0.001), 1.0),
    "topk0.1-bf16": (
        "TopK 0.1% bf16 + EF",
        lambda: tfs.TopK(ratio=0.001, value_dtype="bfloat16"),
        1.0,
    ),
    "qsgd4": ("QSGD s=4", lambda: tfs.QSGD(levels=4, bucket_size=512), 1.0),
    "randomk10": ("RandomK 10% (lr x 0.1)", lambda: tfs.RandomK(ratio=0.1), 0.1),
    "terngrad": ("TernGrad", lambda: tfs.TernGrad(), 1.0),
    "sign": ("ScaledSign + EF", lambda: tfs.ScaledSign(), 1.0),
    "fp16": ("FP16", lambda: tfs.FP16(), 1.0),
    "topk1-late": ("TopK 1% + EF, last late", lambda: tfs.TopK(ratio=0.01), 1.0),
}
#: name -> the SparsifiedOptimizer options it adds
OPTIONS = {"topk1-late": {"late_buckets": "last"}}
DEFAULT = "dense,topk1,topk0.1,topk0.1-bf16,qsgd4,randomk10"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compressors", default=DEFAULT, help=f"comma list of {sorted(COMPRESSORS)}")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--data", default=None, help="local MNIST .npz instead of digits")
    p.add_argument("--out", default="outputs/digits_demo.png", help="PNG path")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=1, help="runs per method, seeds seed, seed+1, ...")
    p.add_argument("--verbose", type=int, default=1, help="Keras progress bar verbosity")
    args = p.parse_args(argv)
    names = args.compressors.split(",")
    unknown = [n for n in names if n not in COMPRESSORS]
    if unknown:
        p.error(f"unknown compressors {unknown}; choose from {sorted(COMPRESSORS)}")
    if args.replicas < 1 or args.epochs < 1 or args.seeds < 1:
        p.error("--replicas, --epochs and --seeds must be >= 1")
    args.names = names
    return args


def load_data(path: str | None):
    """``(x_train, y_train, x_test, y_test)`` as flat float32 features in [0, 1]."""
    if path:
        with np.load(path) as f:
            xs = [
                f[k].reshape(len(f[k]), -1).astype("float32") / 255.0 for k in ("x_train", "x_test")
            ]
            return xs[0], f["y_train"].astype("int64"), xs[1], f["y_test"].astype("int64")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return x_tr, y_tr, x_te, y_te


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * args.replicas
    )
    data = load_data(args.data)
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(args.replicas)])
    seeds = range(args.seed, args.seed + args.seeds)
    rows = []
    for name in args.names:
        label = COMPRESSORS[name][0]
        runs = []
        for seed in seeds:
            print(f"\n== {label}, seed {seed} ==")
            runs.append(train(name, seed, data, strategy, args))
        rows.append(summarize(label, runs, len(data[0]), args))
    print_table(rows, args)
    plot(rows, args.out)
    return rows


def train(name: str, seed: int, data: tuple, strategy, args: argparse.Namespace) -> dict:
    """One run of one method: test accuracy after every epoch, bytes per step, wall time."""
    _, make, lr_factor = COMPRESSORS[name]
    x_tr, y_tr, x_te, y_te = data
    keras.utils.set_random_seed(seed)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input(x_tr.shape[1:]),
                keras.layers.Dense(256, activation="relu"),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        optimizer = keras.optimizers.SGD(args.lr * lr_factor, momentum=0.9)
        if make is not None:
            optimizer = tfs.SparsifiedOptimizer(optimizer, make(), **OPTIONS.get(name, {}))
        model.compile(
            optimizer,
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    curve = AccuracyCurve(x_te, y_te)
    callbacks = [curve] if make is None else [tfs.CompressionStats(), curve]
    start = time.perf_counter()
    history = model.fit(
        x_tr,
        y_tr,
        epochs=args.epochs,
        batch_size=args.batch_size,
        verbose=args.verbose,
        callbacks=callbacks,
    )
    wall = time.perf_counter() - start
    dense = 4 * sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    per_step = history.history["bytes_per_step"][-1] if make else float(dense)
    return {"curve": curve.accuracies, "bytes_per_step": per_step, "dense": dense, "wall_s": wall}


def summarize(label: str, runs: list[dict], train_size: int, args: argparse.Namespace) -> dict:
    """A table row: accuracy over the seeds (mean, standard deviation, each), bytes, time."""
    finals = [run["curve"][-1] for run in runs]
    per_step = runs[0]["bytes_per_step"]  # exact, the same for every seed
    steps_per_epoch = -(-train_size // args.batch_size)
    return {
        "name": label,
        "accuracy": float(np.mean(finals)),
        "std": float(np.std(finals, ddof=1)) if len(finals) > 1 else None,
        "per_seed": finals,
        "bytes_per_step": per_step,
        "ratio": runs[0]["dense"] / per_step,
        "wall_s": float(np.mean([run["wall_s"] for run in runs])),
        "cumulative": [per_step * steps_per_epoch * (e + 1) for e in range(args.epochs)],
        "curve": list(np.mean([run["curve"] for run in runs], axis=0)),
    }


class AccuracyCurve(keras.callbacks.Callback):
    """Test accuracy after every epoch."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        super().__init__()
        self.x, self.y = x, y
        self.accuracies: list[float] = []

    def on_epoch_end(self, epoch, logs=None):
        logits = self.model.predict(self.x, verbose=0)
        self.accuracies.append(float(np.mean(np.argmax(logits, axis=1) == self.y)))


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    seeds = (
        f"seed {args.seed}"
        if args.seeds == 1
        else f"seeds {args.seed}-{args.seed + args.seeds - 1}"
    )
    print(
        f"\n{args.replicas} replicas, {args.epochs} epochs, global batch {args.batch_size}, {seeds}"
    )
    header = f"{'method':<26}{'test acc':>9}{'± std':>8}{'bytes/step':>13}{'ratio':>9}{'wall s':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        std = "-" if r["std"] is None else f"{r['std']:.4f}"
        print(
            f"{r['name']:<26}{r['accuracy']:>9.4f}{std:>8}{r['bytes_per_step']:>13,.0f}"
            f"{r['ratio']:>8.1f}x{r['wall_s']:>9.1f}"
        )
    if args.seeds > 1:
        print("\ntest accuracy per seed (mean and std over seeds above; wall s: mean per run)")
        for r in rows:
            print(f"{r['name']:<26}" + "".join(f"{a:>9.4f}" for a in r["per_seed"]))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot(r["cumulative"], r["curve"], marker=".", label=r["name"])
    ax.set_xscale("log")
    ax.set_xlabel("cumulative bytes sent per replica")
    ax.set_ylabel("test accuracy")
    ax.set_title("digits: accuracy against communication")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
