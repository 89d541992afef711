"""TopK with error feedback: fused op vs TF composite vs NumPy vs a bandwidth reference.

``python benchmarks/bench_topk.py [--n 10000000] [--density 0.01]`` prints, for each n and
density, the best of ``--repeats`` runs of:

* fused: ``tf_sparsify.ops.topk_error_feedback`` eagerly (allocates the new residual), and in
  place (the residual carried through a ``tf.while_loop``, so its buffer is reused);
* TF composite: ``grad + residual``, ``tf.math.top_k(tf.abs(acc))``, sort, gather, scatter;
* NumPy: add, ``np.argpartition`` on ``|acc|``, sort, gather, zero;
* bandwidth references: one pass reading grad and residual and writing the residual into an
  existing buffer (``np.add(..., out=)`` and ``tf.Variable.assign_add``);
* the packed payload around the fused op (``tf.function``): the index code alone (encode, and
  decode of 2 replicas' codes, next to the ScatterSum that follows it), and
  ``TopK.compress_with_feedback`` whole (fused op + encode), also with
  ``value_dtype="bfloat16"`` (+ rounding and the residual fix-up).
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

import tf_sparsify as tfs  # noqa: E402
from tf_sparsify import ops  # noqa: E402
from tf_sparsify.ops import index_code  # noqa: E402


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


def packing_rows(g: tf.Tensor, r: tf.Tensor, k: int, repeats: int) -> dict[str, float]:
    """Times of the packed payload's steps around the fused op, each in a ``tf.function``."""
    n = int(g.shape[0])
    values, idx, _ = ops.topk_error_feedback(g, r, k)
    codes = tf.stack([ops.encode_indices(idx, n)] * 2)
    encode = tf.function(lambda i: ops.encode_indices(i, n), autograph=False)
    decode = tf.function(lambda c: ops.decode_indices(c, n, k, tf.int32), autograph=False)
    ref_encode = tf.function(lambda i: index_code.reference_encode(i, n), autograph=False)
    ref_decode = tf.function(
        lambda c: index_code.reference_decode(c, n, k, tf.int32), autograph=False
    )
    scatter = tf.function(lambda v, i: ops.scatter_sum(v, i, n), autograph=False)
    both = tf.concat([values, values], 0), tf.concat([idx, idx], 0)
    rows = {
        "pack: encode (kernel)": best_ms(lambda: encode(idx), repeats),
        "pack: encode (TF reference)": best_ms(lambda: ref_encode(idx), repeats),
        "pack: decode 2 replicas (kernel)": best_ms(lambda: decode(codes), repeats),
        "pack: decode 2 replicas (TF ref.)": best_ms(lambda: ref_decode(codes), repeats),
        "ScatterSum of 2 replicas' entries": best_ms(lambda: scatter(*both), repeats),
    }
    for value_dtype in (None, "bfloat16"):
        comp = tfs.TopK(k=k, value_dtype=value_dtype)
        step = tf.function(  # payload and residual (the context is not a tensor)
            lambda a, b, c=comp: c.compress_with_feedback(a, b, step=0)[::2], autograph=False
        )
        name = f"TopK({value_dtype or 'float32'}) compress_with_feedback"
        rows[name] = best_ms(lambda s=step: s(g, r), repeats)
    return rows


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
        **packing_rows(g, r, k, repeats),
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
