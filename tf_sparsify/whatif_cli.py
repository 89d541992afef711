"""``python -m tf_sparsify whatif``: predicted ms/step of each exchange method, and the winner.

    python -m tf_sparsify whatif --compute-ms 120 --params 25M --workers 16 --bandwidth 10gbit
    python -m tf_sparsify whatif --compute-ms 120 --model mlp10m --nodes 8 --gpus-per-node 8 \\
        --bandwidth 25gbit --latency 20us --overhead-ms topk=8,topk-sar=10
    python -m tf_sparsify whatif --compute-ms 120 --layers shapes.json --sweep --plot sweep.png

``--layers`` takes a JSON list of tensor shapes (``[[784, 2048], [2048], ...]``) or sizes
(``[1605632, 2048]``, each a vector). The model is in :mod:`tf_sparsify.whatif`.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence

from tf_sparsify import whatif as w

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BYTES = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
SWEEP_BANDWIDTHS = "1gbit,10gbit,100gbit"
SWEEP_WORKERS = range(2, 1025)
#: ``keras.applications`` models by ``--model`` name (ImageNet's 1000 classes, no weights)
KERAS_MODELS = {"resnet50": "ResNet50", "mobilenetv2": "MobileNetV2"}
MODELS = ("mlp10m", *KERAS_MODELS)


def parse_bandwidth(text: str) -> float:
    """Bytes/s from ``<number>[k|m|g|t]bit`` (tc's units, powers of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", text.strip().lower())
    if not match or float(match[1]) <= 0:
        raise ValueError(f"bandwidth {text!r}: expected e.g. 1gbit, 10gbit, 100mbit")
    return float(match[1]) * _SI[match[2]] / 8


def parse_duration(text: str) -> float:
    """Seconds from ``<number>(s|ms|us|ns)``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|ms|us|ns)", text.strip().lower())
    if not match:
        raise ValueError(f"latency {text!r}: expected e.g. 25us, 0.1ms")
    return float(match[1]) * _SECONDS[match[2]]


def parse_size(text: str) -> float:
    """Bytes from ``<number>[b|kb|mb|gb]`` (tc's units, powers of 1024)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(b|kb|mb|gb)?", text.strip().lower())
    if not match:
        raise ValueError(f"size {text!r}: expected e.g. 512kb, 0")
    return float(match[1]) * _BYTES[match[2] or "b"]


def parse_count(text: str) -> int:
    """An integer from ``<number>[k|M|G]`` (powers of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)", text.strip().lower())
    if not match:
        raise ValueError(f"count {text!r}: expected e.g. 25M, 1.5G, 300000")
    return round(float(match[1]) * _SI[match[2]])


def parse_overheads(text: str) -> dict[str, float]:
    """``{"topk": 0.008, ...}`` seconds from ``topk=8,qsgd=20`` (ms)."""
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--overhead-ms {item!r}: expected METHOD=MS")
        out[name.strip()] = float(value) / 1e3
    return out


def load_layers(path: str) -> w.Layers:
    """Shapes from a JSON list of shapes or sizes."""
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list):
        raise ValueError(f"--layers {path}: expected a JSON list of shapes or sizes")
    return w.Layers(tuple(tuple(i) if isinstance(i, list) else (i,) for i in items))


def make_methods(args: argparse.Namespace) -> list[w.Method]:
    """The methods named in ``--methods`` (``hier-X``: X across nodes, dense inside)."""
    topk = {"ratio": args.ratio, "value_bytes": args.value_bytes, "index_bytes": args.index_bytes}
    flat = {
        "dense": lambda: w.DenseAllReduce(4, "dense"),
        "fp16": lambda: w.DenseAllReduce(2, "fp16"),
        "topk": lambda: w.TopKAllGather(**topk),
        "topk-sar": lambda: w.TopKSplitReduce(**topk),
        "qsgd": lambda: w.QSGDAllGather(args.levels),
        "powersgd": lambda: w.PowerSGDAllReduce(args.rank),
    }
    methods: list[w.Method] = []
    for name in filter(None, args.methods.split(",")):
        base = name.removeprefix("hier-")
        if base not in flat:
            raise ValueError(f"--methods {name!r}: choose from {sorted(flat)} or hier-<one>")
        methods.append(flat[base]() if base == name else w.Hierarchical(flat[base]()))
    return methods


def default_methods(gpus_per_node: int) -> str:
    base = "dense,fp16,topk,topk-sar,qsgd,powersgd"
    return base + (",hier-topk,hier-topk-sar" if gpus_per_node > 1 else "")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tf_sparsify whatif",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--compute-ms", type=float, required=True, help="compute per step (ms)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--params", type=parse_count, help="parameters (e.g. 25M): one near-square matrix"
    )
    size.add_argument("--layers", help="JSON list of tensor shapes or sizes")
    size.add_argument("--model", choices=MODELS, help="a known model's shapes")
    p.add_argument("--workers", type=int, help="P workers, one per node (or --nodes)")
    p.add_argument("--nodes", type=int, help="nodes (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument("--bandwidth", type=parse_bandwidth, default="10gbit", help="inter-node")
    p.add_argument("--latency", type=parse_duration, default="25us", help="alpha per round")
    p.add_argument("--call-overhead", type=parse_duration, default="0s", help="per collective call")
    p.add_argument("--intra-bandwidth", type=parse_bandwidth, default="200gbit")
    p.add_argument("--intra-latency", type=parse_duration, default="5us")
    p.add_argument("--schedule", choices=w.SCHEDULES, default="ring")
    p.add_argument("--shared-medium", action="store_true", help="all workers share one limit")
    p.add_argument("--burst", type=parse_size, default="0", help="token bucket (shared medium)")
    p.add_argument("--host-bandwidth", type=parse_bandwidth, help="per-worker host limit")
    p.add_argument("--methods", help="comma list (default: all; hier-* with --gpus-per-node)")
    p.add_argument("--ratio", type=float, default=0.01, help="TopK density")
    p.add_argument("--value-bytes", type=float, default=4, help="TopK bytes per value")
    p.add_argument(
        "--index-bytes", type=float, help="TopK bytes per index (default: packed; topk-sar int32)"
    )
    p.add_argument("--levels", type=int, default=4, help="QSGD levels")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    p.add_argument("--overhead-ms", type=parse_overheads, default={}, help="METHOD=MS,...")
    p.add_argument("--overlap", choices=w.OVERLAPS, default="none")
    p.add_argument("--sweep", action="store_true", help=f"P = 2..1024 at {SWEEP_BANDWIDTHS}")
    p.add_argument("--sweep-bandwidths", default=SWEEP_BANDWIDTHS)
    p.add_argument("--plot", default="outputs/whatif_sweep.png", help="--sweep: PNG path")
    args = p.parse_args(argv)
    if args.workers is not None and args.nodes is not None:
        p.error("give --workers or --nodes, not both")
    if args.methods is None:
        args.methods = default_methods(args.gpus_per_node)
    return args


def keras_layers(name: str) -> w.Layers:
    """The trainable tensor shapes of a ``keras.applications`` model (built without weights:
    nothing is downloaded)."""
    import keras

    model = getattr(keras.applications, KERAS_MODELS[name])(weights=None)
    return w.Layers(tuple(tuple(v.shape) for v in model.trainable_variables))


def layers_of(args: argparse.Namespace) -> w.Layers:
    if args.layers:
        return load_layers(args.layers)
    if args.model:
        return w.MLP10M if args.model == "mlp10m" else keras_layers(args.model)
    return w.Layers.from_params(args.params)


def cluster_of(args: argparse.Namespace, nodes: int | None = None) -> w.Cluster:
    """The cluster of the arguments (``nodes`` overrides ``--workers`` / ``--nodes``)."""
    link = w.Link(
        args.bandwidth,
        args.latency,
        args.shared_medium,
        args.burst,
        args.host_bandwidth or math.inf,
        args.call_overhead,
    )
    nodes = nodes or (args.nodes if args.nodes is not None else args.workers)
    if nodes is None:
        raise ValueError("give --workers (P) or --nodes (with --gpus-per-node)")
    intra = w.Link(args.intra_bandwidth, args.intra_latency)
    return w.Cluster(nodes, link, args.gpus_per_node, intra, args.schedule)


def table(predictions: Sequence[w.Prediction]) -> str:
    """A row per method: bytes one worker (a node's link, for hier-*) sends across nodes per
    step, comm and step ms, and the speed-up over dense."""
    dense = next((p.step for p in predictions if p.method == "dense"), None)
    head = f"{'method':<16}{'inter-node bytes':>19}{'comm ms':>11}{'step ms':>11}{'x dense':>9}"
    lines = [head, "-" * len(head)]
    for p in predictions:
        speedup = f"{dense / p.step:9.2f}" if dense and p.step else f"{'-':>9}"
        ms = f"{1e3 * p.comm:>11.1f}{1e3 * p.step:>11.1f}"
        lines.append(f"{p.method:<16}{p.bytes_sent:>19,.0f}{ms}{speedup}")
    best = w.winner(predictions)
    lines.append(f"winner: {best.method} ({1e3 * best.step:.1f} ms/step)")
    return "\n".join(lines)


def run_once(args: argparse.Namespace, methods: list[w.Method], layers: w.Layers) -> None:
    cluster = cluster_of(args)
    predictions = w.predict(
        methods, layers, cluster, args.compute_ms / 1e3, args.overhead_ms, args.overlap
    )
    shape = f" ({cluster.nodes} x {cluster.gpus_per_node})" if cluster.gpus_per_node > 1 else ""
    print(
        f"{layers.num_params:,} parameters, P = {cluster.workers}{shape}, "
        f"{8 * args.bandwidth / 1e9:g} Gbit/s, alpha {1e6 * args.latency:g} us, "
        f"compute {args.compute_ms:g} ms, overlap {args.overlap}, {args.schedule} schedule"
    )
    print(table(predictions))


def run_sweep(args: argparse.Namespace, methods: list[w.Method], layers: w.Layers) -> None:
    """Winner ranges and a table at powers of two for each bandwidth; the plot."""
    names = [b for b in args.sweep_bandwidths.split(",") if b]
    bandwidths = [parse_bandwidth(b) for b in names]
    g = args.gpus_per_node
    workers = [p for p in SWEEP_WORKERS if p % g == 0]
    cluster = cluster_of(args, nodes=1)
    compute = args.compute_ms / 1e3
    results = w.sweep(
        methods, layers, cluster, compute, bandwidths, workers, args.overhead_ms, args.overlap
    )
    print(
        f"{layers.num_params:,} parameters, compute {args.compute_ms:g} ms, "
        f"alpha {1e6 * args.latency:g} us, {g} per node, overlap {args.overlap}"
    )
    for name, bandwidth in zip(names, bandwidths, strict=True):
        ranges = w.winner_ranges(results[bandwidth])
        print(f"{name}: " + "; ".join(f"P {a}-{b}: {m}" for a, b, m in ranges))
    print(sweep_table(names, bandwidths, results))
    plot_sweep(names, bandwidths, results, args.plot)
    print(f"wrote {args.plot}")


def sweep_table(names: Sequence[str], bandwidths: Sequence[float], results: dict) -> str:
    """At powers of two, a column per bandwidth: the winner, its ms/step and dense's."""
    powers = [p for p in results[bandwidths[0]] if p & (p - 1) == 0]
    lines = [f"{'P':>6}" + "".join(f"{n + ': winner ms (dense ms)':>34}" for n in names)]
    for p in powers:
        cells = []
        for bandwidth in bandwidths:
            predictions = results[bandwidth][p]
            best = w.winner(predictions)
            dense = next((x.step for x in predictions if x.method == "dense"), math.nan)
            cells.append(f"{best.method} {1e3 * best.step:.0f} ({1e3 * dense:.0f})")
        lines.append(f"{p:>6}" + "".join(f"{c:>34}" for c in cells))
    return "\n".join(lines)


def plot_sweep(names: Sequence[str], bandwidths: Sequence[float], results: dict, path: str) -> None:
    """ms/step against P, a line per method, a panel per bandwidth (PNG)."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4.2), squeeze=False)
    for ax, name, bandwidth in zip(axes[0], names, bandwidths, strict=True):
        by_p = results[bandwidth]
        ps = sorted(by_p)
        for i, method in enumerate(pred.method for pred in by_p[ps[0]]):
            ax.plot(ps, [1e3 * by_p[p][i].step for p in ps], label=method)
        wins = ", ".join(f"{m} {a}-{b}" for a, b, m in w.winner_ranges(by_p))
        ax.set_title(f"{name}, fastest: {wins}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers P")
        ax.set_ylabel("predicted ms/step")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        methods, layers = make_methods(args), layers_of(args)
        (run_sweep if args.sweep else run_once)(args, methods, layers)
    except (ValueError, OSError) as error:
        print(f"whatif: {error}", file=sys.stderr)
        return 2
    return 0
