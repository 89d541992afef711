"""QSGD: fused quantize / dequantize ops vs the pure-TF reference vs NumPy vs bandwidth.

``python benchmarks/bench_qsgd.py [--n 10000000] [--config 4:512] [--dtype float16]`` prints, for
each n, ``levels:bucket_size`` configuration (bucket 0 = one bucket) and dtype (float32 by
default), the best of ``--repeats`` runs of:

* fused: ``tf_sparsify.ops.qsgd_quantize`` and ``qsgd_dequantize``;
* TF composite: the same computation in TensorFlow ops (``tf_sparsify.ops.pure_tf``);
* NumPy: the NumPy model of the op (``tf_sparsify.testing.numpy_reference``);
* bandwidth: one pass reading the float32 input and writing an int8 payload
  (``np.copyto`` with an unsafe cast into an existing buffer).

Outputs are allocated afresh on every call: above 32 MB (the decoded float32 tensor at
n = 10M) glibc maps new pages each time, whose page faults then dominate the decoders;
``TF_CPU_ALLOCATOR_USE_BFC=true`` reuses memory and shows the kernels' own costs.
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
from tf_sparsify.ops import pure_tf as reference  # noqa: E402
from tf_sparsify.testing import numpy_reference  # noqa: E402


def run(n: int, levels: int, bucket: int, dtype: tf.DType, repeats: int) -> None:
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    t = tf.cast(tf.constant(x), dtype)
    seed = tf.constant(1, tf.int64)
    q, norms = ops.qsgd_quantize(t, levels, bucket, seed)
    ref_quantize = tf.function(lambda v: reference.qsgd_quantize(v, levels, bucket, seed))
    ref_dequantize = tf.function(
        lambda a, b: reference.qsgd_dequantize(a, b, levels, bucket, [n], dtype)
    )
    payload = np.empty(n, np.int8 if levels <= 127 else np.int16)
    bits = x.view(np.uint32)
    rows = {
        "fused quantize": best_ms(lambda: ops.qsgd_quantize(t, levels, bucket, seed), repeats),
        "TF composite quantize (tf.function)": best_ms(lambda: ref_quantize(t), repeats),
        "NumPy quantize (float32)": best_ms(
            lambda: numpy_reference.qsgd_quantize(bits, "float32", levels, bucket, 1),
            max(repeats // 2, 1),
        ),
        "fused dequantize": best_ms(
            lambda: ops.qsgd_dequantize(q, norms, levels, bucket, [n], dtype), repeats
        ),
        "TF composite dequantize (tf.function)": best_ms(lambda: ref_dequantize(q, norms), repeats),
        "bandwidth: float32 -> int8 copy": best_ms(
            lambda: np.copyto(payload, x, casting="unsafe"), repeats
        ),
    }
    fused = rows["fused quantize"]
    print(
        f"\nn = {n:,}, levels = {levels}, bucket_size = {bucket}, {dtype.name}, best of {repeats}"
    )
    for name, ms in rows.items():
        print(f"  {name:40s} {ms:9.2f} ms   {ms / fused:7.2f}x fused quantize")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1_000_000, 10_000_000, 50_000_000])
    parser.add_argument(
        "--config", nargs="+", default=["4:512", "127:0"], help="levels:bucket_size pairs"
    )
    parser.add_argument("--dtype", nargs="+", default=["float32"], help="input/output dtypes")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"TensorFlow {tf.__version__}; {ops.info()}")
    for n in args.n:
        for config in args.config:
            levels, bucket = (int(v) for v in config.split(":"))
            for dtype in args.dtype:
                run(n, levels, bucket, tf.as_dtype(dtype), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
