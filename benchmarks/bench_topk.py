"""TopK with error feedback: fused op vs TF composite vs NumPy vs a bandwidth reference.

``python benchmarks/bench_topk.py [--n 10000000] [--density 0.01]`` prints, for each n and
density, the best of ``--repeats`` runs of:

* fused: ``tf_sparsify.ops.topk_error_feedback`` eagerly (allocates the new residual), and in
  place (the residual carried through a ``tf.while_loop``, so its buffer is reused);
* TF composite: ``grad + residual``, ``tf.math.top_k(tf.abs(acc))``, sort, gather, scatter;
* NumPy: add, ``np.argpartition`` on ``|acc|``, sort, gather, zero;
* bandwidth references: one pass reading grad and residual and writing the residual into an
  existing buffer (``np.add(..., out=)`` and ``tf.Variable.assign_add``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# TensorFlow's C++ log lines off unless the user asked for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import best_ms  # noqa: E402

from tf_sparsify import ops  # noqa: E402


def in_place_ms(grad: tf.Tensor, residual: tf.Tensor, k: int, repeats: int) -> float:
    """Per-step time with the residual forwarded: (11 steps - 1 step) / 10."""

    @tf.function
    def steps(g, r, count):
        def body(i, res):
            _, _, res = ops.topk_error_feedback(g, res, k)
            return i + 1, res

        return tf.while_loop(lambda i, _: i < count, body, (tf.constant(0), r))[1]

    one = best_ms(lambda: steps(grad, residual, tf.constant(1)), repeats)
    eleven = best_ms(lambda: steps(grad, residual, tf.constant(11)), repeats)
    return (eleven - one) / 10


def composite(g: tf.Tensor, r: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    acc = g + r
    _, idx = tf.math.top_k(tf.abs(acc), k=k, sorted=False)
    idx = tf.sort(idx)
    values = tf.gather(acc, idx)
    new = tf.tensor_scatter_nd_update(acc, idx[:, None], tf.zeros_like(values))
    return values, idx, new


def numpy_path(g: np.ndarray, r: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    acc = g + r
    idx = np.sort(np.argpartition(np.abs(acc), acc.size - k)[acc.size - k :])
    values = acc[idx]
    acc[idx] = 0
    return values, idx


def run(n: int, density: float, repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    k = max(int(n * density), 1)
    gn = rng.standard_normal(n, dtype=np.float32)
    rn = rng.standard_normal(n, dtype=np.float32)
    g, r = tf.constant(gn), tf.constant(rn)
    fused_composite = tf.function(composite)
    var = tf.Variable(r)
    out = rn.copy()
    rows = {
        "fused op, eager (new residual)": best_ms(
            lambda: ops.topk_error_feedback(g, r, k), repeats
        ),
        "fused op, in place (tf.while_loop)": in_place_ms(g, r, k, repeats),
        "TF composite (tf.function)": best_ms(lambda: fused_composite(g, r, k), repeats),
        "NumPy argpartition path": best_ms(lambda: numpy_path(gn, rn, k), repeats),
        "bandwidth: np.add(g, r, out=r)": best_ms(lambda: np.add(gn, out, out=out), repeats),
        "bandwidth: Variable.assign_add": best_ms(lambda: var.assign_add(g), repeats),
    }
    fused = rows["fused op, eager (new residual)"]
    print(f"\nn = {n:,}, k = {k:,} ({density:.1%}), float32, best of {repeats}")
    for name, ms in rows.items():
        print(f"  {name:38s} {ms:9.2f} ms   {ms / fused:7.2f}x eager fused")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    parser.add_argument("--density", type=float, nargs="+", default=[0.001, 0.01])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"TensorFlow {tf.__version__}; {ops.info()}")
    if not ops.is_compiled():
        print("the fused op runs the pure-TF reference: build with python -m tf_sparsify.ops.build")
    results = {(n, d): run(n, d, args.repeats) for n in args.n for d in args.density}
    if (10_000_000, 0.01) in results:
        rows = results[(10_000_000, 0.01)]
        bandwidth = rows["bandwidth: np.add(g, r, out=r)"]
        speedup = rows["TF composite (tf.function)"] / rows["fused op, eager (new residual)"]
        print("\ntargets at n = 10M, k = 1%:")
        print(f"  TF composite / fused (eager)   = {speedup:6.2f}   (goal >= 8)")
        for name in ("fused op, eager (new residual)", "fused op, in place (tf.while_loop)"):
            ratio = rows[name] / bandwidth
            print(f"  {name} / np.add = {ratio:6.2f}   (goal <= 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
