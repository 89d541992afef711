"""Per-step overhead of the wrapper on one device: ``model.fit`` step time against plain SGD.

``python benchmarks/bench_overhead.py`` trains the 10M-parameter MLP 784-2048-2048-2048-10 on
synthetic data (batch 128) with plain ``SGD`` and with ``SparsifiedOptimizer(SGD, C)`` for each
compressor ``C`` (``--model mobilenetv2`` or ``transformer``: the network benchmark's model,
synthetic data and per-process batch, 64 images or 4 sequences), interleaved in rounds
(A B C A B C ...) on this noisy machine, and prints the best epoch's ms/step of each and its
ratio to plain SGD, all measured in the same run.
``--momentum 0.9`` gives every configuration SGD with momentum. ``topk1_diagnostics`` and
``topk1_norms``: TopK 1% recording the diagnostics, or only the gradient norms
(``AutoCompression``'s record), every 5 steps. ``--profile DIR`` also writes a
TensorFlow profiler trace of a few steps of each configuration.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# TensorFlow's C++ log lines off unless the user asked for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sparsify as tfs  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.network.models import BATCH, LATE, make_model, synthetic_batch  # noqa: E402

MODELS = ("mlp10m", "mobilenetv2", "transformer")

CONFIGS = {
    "sgd": None,
    "identity": lambda: tfs.Identity(),
    "topk1": lambda: tfs.TopK(ratio=0.01),
    "topk0.1": lambda: tfs.TopK(ratio=0.001),
    "qsgd4": lambda: tfs.QSGD(4),
    "fp16": lambda: tfs.FP16(),
    "bf16": lambda: tfs.BF16(),
}
#: name -> (configuration, the record it writes every RECORD_EVERY steps)
RECORDS = {"topk1_diagnostics": ("topk1", "diagnostics"), "topk1_norms": ("topk1", "grad_sq_norms")}
RECORD_EVERY = 5


def mlp(widths: tuple[int, ...]) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers = [keras.Input((widths[0],))]
    layers += [keras.layers.Dense(w, activation="relu") for w in widths[1:-1]]
    layers.append(keras.layers.Dense(widths[-1]))
    return keras.Sequential(layers)


def synthetic_data(model: str, widths: tuple[int, ...], rows: int) -> tuple[np.ndarray, ...]:
    """``rows`` examples and labels for ``model``."""
    if model != "mlp10m":
        return synthetic_batch(model, image_size=32, batch=rows, seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, widths[0])).astype("float32")
    return x, rng.integers(0, widths[-1], size=rows)


def compiled(
    name: str, model_name: str, widths: tuple[int, ...], momentum: float = 0.0
) -> keras.Model:
    optimizer = keras.optimizers.SGD(0.01, momentum=momentum)
    base, late = LATE.get(name, (name, "none"))
    base, record = RECORDS.get(base, (base, None))
    if CONFIGS[base] is not None:
        optimizer = tfs.SparsifiedOptimizer(optimizer, CONFIGS[base](), late_buckets=late)
    if record is not None:
        getattr(optimizer, f"enable_{record}")(RECORD_EVERY)
    # mlp10m: the MLP of --widths; else the network benchmark's model
    model = mlp(widths) if model_name == "mlp10m" else make_model(model_name, 32, seed=0)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


class EpochTimer(keras.callbacks.Callback):
    """Wall time of each epoch."""

    def __init__(self):
        super().__init__()
        self.seconds: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs", default="sgd,topk1,qsgd4", help=f"comma list of {[*CONFIGS, *LATE, *RECORDS]}"
    )
    parser.add_argument("--model", choices=MODELS, default="mlp10m")
    parser.add_argument("--widths", default="784,2048,2048,2048,10", help="mlp10m's layers")
    parser.add_argument(
        "--batch",
        type=int,
        help="default: 128 (mlp10m), else as the network benchmark's per process",
    )
    parser.add_argument("--steps", type=int, default=10, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per round")
    parser.add_argument("--profile", default=None, help="write a profiler trace here")
    parser.add_argument("--momentum", type=float, default=0.0, help="inner SGD's momentum")
    args = parser.parse_args()
    names = args.configs.split(",")
    widths = tuple(int(w) for w in args.widths.split(","))
    if args.batch is None:
        args.batch = 128 if args.model == "mlp10m" else BATCH[args.model]
    x, y = synthetic_data(args.model, widths, args.batch * args.steps)
    models = {name: compiled(name, args.model, widths, args.momentum) for name in names}
    for model in models.values():  # trace and warm up
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    best = dict.fromkeys(names, float("inf"))
    for r in range(args.rounds):
        for name in names:
            timer = EpochTimer()
            models[name].fit(
                x, y, batch_size=args.batch, epochs=args.epochs, verbose=0, callbacks=[timer]
            )
            best[name] = min(best[name], 1e3 * min(timer.seconds) / args.steps)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {best[n]:.1f}" for n in names))
    base = best[names[0]]
    print(f"\n{'config':<10} {'ms/step':>9} {'x ' + names[0]:>9}")
    for name in names:
        print(f"{name:<10} {best[name]:9.1f} {best[name] / base:9.3f}")
    if args.profile:
        for name in names:
            tf.profiler.experimental.start(os.path.join(args.profile, name))
            models[name].fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
            tf.profiler.experimental.stop()


if __name__ == "__main__":
    main()
