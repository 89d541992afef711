"""Decompression of sparse payloads: ScatterSum vs tf.scatter_nd vs unsorted_segment_sum.

``python benchmarks/bench_scatter.py [--n 4200000 10000000] [--density 0.01 0.001]`` prints, for
each n and density, the best of ``--repeats`` eager calls that build a dense float32 ``[n]`` from
two replicas' TopK payloads (each replica's ``k = density * n`` ascending distinct indices,
concatenated, as ``TopK.decompress_sum`` receives them):

* ``tf_sparsify.ops.scatter_sum`` (the compiled op);
* ``tf.scatter_nd(indices[:, None], values, [n])`` (what the compressors used before);
* ``tf.math.unsorted_segment_sum(values, indices, n)`` (the op's pure-TF reference, without its
  range check);
* a zero-fill of the same bytes (``tf.zeros([n])``), the floor of any dense decode.

Every row allocates a fresh ``[n]`` output. Above 32 MB (n = 10M float32) glibc's malloc maps
new pages for each allocation, whose page faults then cost more than any of the ops;
``TF_CPU_ALLOCATOR_USE_BFC=true`` (TensorFlow's pooling allocator on CPU) or a larger
``MALLOC_MMAP_THRESHOLD_`` reuses memory instead and shows the ops' own costs.
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

REPLICAS = 2


def payloads(n: int, density: float) -> tuple[tf.Tensor, tf.Tensor]:
    """Values and indices of REPLICAS TopK payloads of k = density * n entries each."""
    rng = np.random.default_rng(0)
    k = max(int(n * density), 1)
    indices = np.concatenate([np.sort(rng.choice(n, k, replace=False)) for _ in range(REPLICAS)])
    values = rng.standard_normal(indices.size, dtype=np.float32)
    return tf.constant(values), tf.constant(indices.astype(np.int32))


def run(n: int, density: float, repeats: int) -> dict[str, float]:
    values, indices = payloads(n, density)
    rows = {
        "ScatterSum (ops.scatter_sum)": best_ms(
            lambda: ops.scatter_sum(values, indices, n), repeats
        ),
        "tf.scatter_nd": best_ms(lambda: tf.scatter_nd(indices[:, None], values, [n]), repeats),
        "tf.math.unsorted_segment_sum": best_ms(
            lambda: tf.math.unsorted_segment_sum(values, indices, n), repeats
        ),
        "zero-fill of n float32 (tf.zeros)": best_ms(lambda: tf.zeros([n]), repeats),
    }
    fused = rows["ScatterSum (ops.scatter_sum)"]
    fill = rows["zero-fill of n float32 (tf.zeros)"]
    print(
        f"\nn = {n:,}, {REPLICAS} x k = {indices.shape[0] // REPLICAS:,} ({density:.1%}), "
        f"float32, best of {repeats}"
    )
    for name, ms in rows.items():
        print(f"  {name:36s} {ms:8.2f} ms   {ms / fused:6.2f}x ScatterSum   {ms / fill:6.2f}x fill")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4_200_000, 10_000_000])
    parser.add_argument("--density", type=float, nargs="+", default=[0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"TensorFlow {tf.__version__}; {ops.info()}")
    if not ops.is_compiled():
        print("ScatterSum runs the pure-TF reference: build with python -m tf_sparsify.ops.build")
    for n in args.n:
        for density in args.density:
            run(n, density, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
