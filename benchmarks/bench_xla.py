"""Train steps compiled by XLA against plain graph steps: TopK 1% with error feedback.

``python benchmarks/bench_xla.py`` trains the 10M-parameter MLP of ``bench_overhead.py``
(784-2048-2048-2048-10, synthetic data, batch 128) with ``SparsifiedOptimizer(SGD,
TopK(ratio=0.01))`` compiled with ``jit_compile=True`` (XLA: the pure-TF reference of the ops)
and ``jit_compile=False`` (the compiled kernels), interleaved in rounds (A B A B ...) on this
noisy machine, and prints the median ms/step of each over all timed epochs and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics

# TensorFlow's C++ log lines off unless the user asked for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from bench_overhead import EpochTimer, mlp  # noqa: E402

import tf_sparsify as tfs  # noqa: E402

MODES = {"xla": True, "graph": False}


def compiled(jit_compile: bool, widths: tuple[int, ...], ratio: float) -> keras.Model:
    """The MLP with TopK(ratio) and error feedback around SGD, compiled as asked."""
    optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.01), tfs.TopK(ratio=ratio))
    model = mlp(widths)
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="784,2048,2048,2048,10")
    parser.add_argument("--ratio", type=float, default=0.01, help="TopK density")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="steps per epoch")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per round")
    args = parser.parse_args()
    widths = tuple(int(w) for w in args.widths.split(","))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, widths[0])).astype("float32")
    y = rng.integers(0, widths[-1], size=len(x))
    models = {name: compiled(jit, widths, args.ratio) for name, jit in MODES.items()}
    for model in models.values():  # trace, compile and warm up
        model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)
    step_ms: dict[str, list[float]] = {name: [] for name in MODES}
    for r in range(args.rounds):
        for name, model in models.items():
            timer = EpochTimer()
            model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0, callbacks=[timer])
            step_ms[name] += [1e3 * s / args.steps for s in timer.seconds]
        latest = ", ".join(f"{n} {statistics.median(t):.1f}" for n, t in step_ms.items())
        print(f"round {r + 1}/{args.rounds} (median ms/step so far): {latest}")
    median = {name: statistics.median(times) for name, times in step_ms.items()}
    print(f"\nTopK {args.ratio:g} + EF, MLP {args.widths}, batch {args.batch}")
    print(f"{'jit_compile':<12} {'ms/step':>9} {'x graph':>9}")
    for name, jit in MODES.items():
        print(f"{str(jit):<12} {median[name]:9.1f} {median[name] / median['graph']:9.3f}")


if __name__ == "__main__":
    main()
