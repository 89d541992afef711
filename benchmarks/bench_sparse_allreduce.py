"""Bytes per worker of the sparse all-reduce against TopK's all-gather, at P = 2, 3, 4.

``python benchmarks/bench_sparse_allreduce.py`` launches ``horovodrun -np P --gloo`` (without its
start-up check: :mod:`benchmarks.horovodrun`) for each
``P`` (``--ranks``); every rank trains the same MLP (784-512-256-10, its own synthetic shard)
for ``--steps`` steps with plain SGD on the update of ``TopK(ratio)`` (gathered) and of
``SparseAllReduce(ratio)`` (split and reduced), each through the real pipeline and
``HorovodCollective``, and counts per step what it hands to Horovod (the collective's byte
counter) and what Horovod hands back from the other ranks (the results' sizes at run time,
less this rank's own rows). The table shows their mean and maximum over ranks and steps, and
``2 k (v + i) (P - 1) / P``, the sparse all-reduce's traffic when the entries spread evenly
(bounded by ``2 k (v + i)`` whatever ``P``; TopK's all-gather receives ``(P - 1)`` payloads).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.horovodrun import COMMAND as HOROVODRUN  # noqa: E402

WIDTHS = (784, 512, 256, 10)
PREFIX = "RESULT "


def launch(ranks: int, ratio: float, steps: int, timeout: int) -> list[dict]:
    """One ``horovodrun`` job; each rank's records."""
    command = [*HOROVODRUN, "-np", str(ranks), "--gloo", sys.executable, __file__, "--worker"]
    command += ["--ratio", str(ratio), "--steps", str(steps)]
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [s.split(PREFIX, 1)[1] for s in proc.stdout.splitlines() if PREFIX in s]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return [json.loads(s) for s in lines]


def table(rows: dict[int, list[dict]]) -> str:
    """Markdown: per P and method, bytes sent and received per worker and step."""
    out = [
        "| P | method | sent to Horovod (mean / max) | received from others (mean / max) "
        "| 2k(v+i)(P-1)/P |",
        "|---|---|---|---|---|",
    ]
    for ranks, records in sorted(rows.items()):
        for method in ("TopK all-gather", "SparseAllReduce"):
            mine = [r for r in records if r["method"] == method]
            sent = [s for r in mine for s in r["sent"]]
            got = [g for r in mine for g in r["received"]]
            even = 2 * mine[0]["k_bytes"] * (ranks - 1) / ranks
            flat = f"{even:,.0f}" if method == "SparseAllReduce" else ""
            out.append(
                f"| {ranks} | {method} | {sum(sent) / len(sent):,.0f} / {max(sent):,} "
                f"| {sum(got) / len(got):,.0f} / {max(got):,} | {flat} |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.ratio, args.steps)
        return
    rows = {p: launch(p, args.ratio, args.steps, args.timeout) for p in args.ranks}
    params = sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:], strict=False))
    print(
        f"MLP {'-'.join(map(str, WIDTHS))} ({params:,} parameters), ratio {args.ratio}, "
        f"{args.steps} steps; bytes per worker and step (SparseAllReduce: float32 value + int32 "
        "index per entry; TopK: float32 values + its packed index code)"
    )
    print(table(rows))


# -- one rank ------------------------------------------------------------------------------------
def worker(ratio: float, steps: int) -> None:
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_sparsify as tfs
    from benchmarks.horovodrun import require_gloo
    from tf_sparsify.core.pipeline import GradientPipeline
    from tf_sparsify.core.step import StepMemory
    from tf_sparsify.horovod import HorovodCollective

    class Counting(HorovodCollective):
        """A HorovodCollective that also counts the bytes it receives from the other ranks."""

        def __init__(self, sent: tf.Variable, received: tf.Variable):
            super().__init__(counter=sent)
            self.received = received

        def _tally(self, results: list, own: list) -> list:
            self.received.assign_add(tf.add_n([_nbytes(r) for r in results]) - tf.add_n(own))
            return results

        def all_gather(self, tensors):
            return self._tally(super().all_gather(tensors), [_nbytes(t) for t in tensors])

        def all_gather_rows(self, tensors):
            return self._tally(super().all_gather_rows(tensors), [_nbytes(t) for t in tensors])

        def all_to_all(self, tensors, splits):
            rank = hvd.rank()
            own = [
                tf.cast(s[rank], tf.int64) * (_nbytes(t) // tf.maximum(tf.shape(t, tf.int64)[0], 1))
                for t, s in zip(tensors, splits, strict=True)
            ]
            return self._tally(super().all_to_all(tensors, splits), own)

    def _nbytes(t: tf.Tensor) -> tf.Tensor:
        return tf.size(t, out_type=tf.int64) * t.dtype.size

    require_gloo()
    hvd.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((WIDTHS[0],))]
        + [keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:-1]]
        + [keras.layers.Dense(WIDTHS[-1])]
    )
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(steps * 32, WIDTHS[0])).astype("float32")
    y = rng.integers(0, WIDTHS[-1], steps * 32)
    methods = {"TopK all-gather": tfs.TopK, "SparseAllReduce": tfs.SparseAllReduce}
    for method, make in methods.items():
        compressor = make(ratio=ratio)
        pipeline = GradientPipeline(compressor)
        weights = [tf.Variable(v) for v in model.get_weights()]
        shapes = [w.shape for w in weights]
        units = pipeline.plan(shapes, [tf.float32] * len(shapes))
        residuals = [tf.zeros(s) for s in shapes]
        sent_var, got_var = tf.Variable(0, dtype=tf.int64), tf.Variable(0, dtype=tf.int64)
        sent, received = [], []
        for t in range(steps):
            model.set_weights([w.numpy() for w in weights])
            with tf.GradientTape() as tape:
                loss = loss_fn(y[t * 32 : t * 32 + 32], model(x[t * 32 : t * 32 + 32]))
            grads = tape.gradient(loss, model.trainable_variables)
            before = (int(sent_var.numpy()), int(got_var.numpy()))
            collective = Counting(sent_var, got_var)
            memory = StepMemory(residuals, tf.constant(t, tf.int64))
            out = pipeline.run(units, grads, memory, collective)
            residuals = out.residuals
            for w, u in zip(weights, out.updates, strict=True):
                w.assign_sub(0.1 * u)
            sent.append(int(sent_var.numpy()) - before[0])
            received.append(int(got_var.numpy()) - before[1])
        k_entries = sum(compressor.num_selected(int(np.prod(s))) for s in shapes)
        record = {
            "rank": hvd.rank(),
            "method": method,
            "sent": sent,
            "received": received,
            "k_bytes": k_entries * 8,
        }
        print(PREFIX + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
