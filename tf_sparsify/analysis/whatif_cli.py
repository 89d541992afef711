"""``python -m tf_sparsify whatif``: predicted ms/step of each exchange method, and the winner.

    python -m tf_sparsify whatif --compute-ms 120 --params 25M --workers 16 --bandwidth 10gbit
    python -m tf_sparsify whatif --compute-ms 120 --model mlp10m --nodes 8 --gpus-per-node 8 \\
        --bandwidth 25gbit --latency 20us --overhead-ms topk=8,topk-sar=10
    python -m tf_sparsify whatif --compute-ms 120 --layers shapes.json --sweep --plot sweep.png

``--layers`` takes the path of a JSON file holding a list of tensor shapes (``[[784, 2048],
[2048], ...]``) or sizes (``[1605632, 2048]``, each a vector). The model is in
:mod:`tf_sparsify.analysis.whatif`.
"""

from __future__ import annotations

import argparse
import decimal
import json
import math
import os
import re
from collections.abc import Sequence

from tf_sparsify.analysis import whatif as w
from tf_sparsify.compressors.qsgd import MAX_LEVELS as MAX_QSGD_LEVELS

_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BYTES = {"b": 1, "kb": 1024, "mb": 1024**2, "gb": 1024**3}
_COUNT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
SWEEP_BANDWIDTHS = "1gbit,10gbit,100gbit"
SWEEP_WORKERS = range(2, 1025)
PLOT = "outputs/whatif_sweep.png"
#: the largest model ``--params`` / ``--layers`` take (int64 element counts)
MAX_PARAMS = 2**63 - 1
#: ``keras.applications`` models by ``--model`` name (ImageNet's 1000 classes, no weights)
KERAS_MODELS = {"resnet50": "ResNet50", "mobilenetv2": "MobileNetV2"}
MODELS = ("mlp10m", *KERAS_MODELS)
FLAT_METHODS = ("dense", "fp16", "topk", "topk-sar", "qsgd", "powersgd")
#: method options (their defaults) and the base methods they shape
METHOD_OPTIONS = {
    "ratio": (0.01, ("topk", "topk-sar")),
    "value_bytes": (4.0, ("topk", "topk-sar")),
    "index_bytes": (None, ("topk", "topk-sar")),
    "levels": (4, ("qsgd",)),
    "rank": (4, ("powersgd",)),
}


class OptionError(argparse.ArgumentTypeError, ValueError):
    """A bad option value. argparse reports it as ``argument --option: <message>``; callers of
    the ``parse_*`` functions outside argparse can catch it as a ValueError."""


def _finite(value: float, text: str, expected: str) -> float:
    if not math.isfinite(value):
        raise OptionError(f"{text!r}: too large; expected e.g. {expected}")
    return value


def parse_bandwidth(text: str) -> float:
    """Bytes/s from ``<number>[k|m|g|t]bit`` (tc's units, powers of 1000)."""
    expected = "1gbit, 10gbit, 100mbit"
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", text.strip().lower())
    if not match or float(match[1]) <= 0:
        raise OptionError(f"{text!r}: expected a bandwidth > 0, e.g. {expected}")
    return _finite(float(match[1]) * _SI[match[2]] / 8, text, expected)


def parse_duration(text: str) -> float:
    """Seconds from ``<number>(s|ms|us|ns)``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|ms|us|ns)", text.strip().lower())
    if not match:
        raise OptionError(f"{text!r}: expected a duration with its unit, e.g. 25us, 0.1ms, 0s")
    return _finite(float(match[1]) * _SECONDS[match[2]], text, "25us")


def parse_size(text: str) -> float:
    """Bytes from ``<number>[b|kb|mb|gb]`` (tc's units, powers of 1024)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(b|kb|mb|gb)?", text.strip().lower())
    if not match:
        raise OptionError(f"{text!r}: expected a size, e.g. 512kb, 0")
    return _finite(float(match[1]) * _BYTES[match[2] or "b"], text, "512kb")


def parse_count(text: str) -> int:
    """A whole number >= 1 from ``<number>[k|M|G]`` (powers of 1000)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)", text.strip().lower())
    if not match:
        raise OptionError(f"{text!r}: expected a count, e.g. 25M, 1.5G, 300000")
    count = decimal.Decimal(match[1]) * _COUNT[match[2]]
    if count != count.to_integral_value() or not 1 <= count <= MAX_PARAMS:
        raise OptionError(f"{text!r}: expected a whole number from 1 to 2^63 - 1, e.g. 25M")
    return int(count)


def _overhead_items(text: str) -> list[tuple[str, float, str]]:
    """``(method, ms, item)`` of each ``METHOD=MS`` in a comma list (at least one)."""
    expected = "expected METHOD=MS[,METHOD=MS...], MS >= 0 (milliseconds), e.g. topk=8,qsgd=20"
    items = []
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not name or not sep or not math.isfinite(ms) or ms < 0:
            where = "" if item == text.strip() else f" in {text!r}"
            raise OptionError(f"{item!r}{where}: {expected}")
        items.append((name, ms, item))
    if not items:
        raise OptionError(f"{text!r}: {expected}")
    return items


def _merge_overheads(groups: Sequence[list[tuple[str, float, str]]]) -> dict[str, float]:
    """``{method: seconds}``; a method given twice (in one list or across lists) is an error."""
    out: dict[str, float] = {}
    first: dict[str, str] = {}
    for name, ms, item in (entry for group in groups for entry in group):
        if name in first:
            raise OptionError(f"{name!r} given twice ({first[name]!r}, then {item!r})")
        first[name], out[name] = item, ms / 1e3
    return out


def parse_overheads(text: str) -> dict[str, float]:
    """``{"topk": 0.008, ...}`` seconds from ``topk=8,qsgd=20`` (ms)."""
    return _merge_overheads([_overhead_items(text)])


def number(minimum: float = 0.0, inclusive: bool = True, maximum: float = math.inf):
    """An argparse type: a finite float ``>= minimum`` (``>`` if not inclusive),
    ``<= maximum``; the error quotes the text given."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low = value >= minimum if inclusive else value > minimum
        if not (math.isfinite(value) and low and value <= maximum):
            relation = ">=" if inclusive else ">"
            bound = f" and <= {maximum:g}" if maximum != math.inf else ""
            raise OptionError(
                f"expected a finite number {relation} {minimum:g}{bound}; got {text!r}"
            )
        return value

    return parse


def integer(minimum: int = 1, maximum: int | None = None, note: str = ""):
    """An argparse type: an integer in ``[minimum, maximum]``; the error quotes the text given."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            bound = f" and <= {maximum}" if maximum is not None else ""
            raise OptionError(f"expected an integer >= {minimum}{bound}{note}; got {text!r}")
        return value

    return parse


def load_layers(path: str) -> w.Layers:
    """Shapes from the JSON file at ``path``: a list of shapes or sizes."""
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list):
        raise ValueError("expected a JSON list of shapes or sizes")
    layers = w.Layers(tuple(tuple(i) if isinstance(i, list) else (i,) for i in items))
    if layers.num_params > MAX_PARAMS:
        raise ValueError(f"{layers.num_params} parameters: at most 2^63 - 1")
    return layers


def method_names(text: str) -> list[str]:
    """The names of a ``--methods`` comma list, checked (known, each once, at least one)."""
    names = [name for name in (n.strip() for n in text.split(",")) if name]
    choices = f"choose from {', '.join(FLAT_METHODS)} or hier-<one of them>"
    if not names:
        raise ValueError(f"{text!r}: expected a comma list of methods; {choices}")
    for i, name in enumerate(names):
        if name.removeprefix("hier-") not in FLAT_METHODS:
            raise ValueError(f"{name!r} in {text!r}: {choices}")
        if name in names[:i]:
            raise ValueError(f"{name!r} given twice in {text!r}")
    return names


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
    for name in method_names(args.methods):
        base = name.removeprefix("hier-")
        methods.append(flat[base]() if base == name else w.Hierarchical(flat[base]()))
    return methods


def default_methods(gpus_per_node: int) -> str:
    base = ",".join(FLAT_METHODS)
    return base + (",hier-topk,hier-topk-sar" if gpus_per_node > 1 else "")


def build_parser() -> argparse.ArgumentParser:
    """The options; a default of None marks an option whose use :func:`check_args` checks
    against the others (given where it has no effect: an error), filled in there."""
    p = argparse.ArgumentParser(
        prog="python -m tf_sparsify whatif",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--compute-ms", type=number(0), required=True, help="compute per step (ms)")
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument(
        "--params", type=parse_count, help="parameters (e.g. 25M): one near-square matrix"
    )
    size.add_argument(
        "--layers",
        metavar="FILE.json",
        help="JSON file holding a list of tensor shapes or sizes, e.g. [[784, 2048], [2048]]",
    )
    size.add_argument("--model", choices=MODELS, help="a known model's shapes")
    one_per_node = " (P: one worker per node, so the number of nodes)"
    p.add_argument(
        "--workers", type=integer(1, note=one_per_node), help="P workers, one per node (or --nodes)"
    )
    p.add_argument("--nodes", type=integer(1), help="nodes (with --gpus-per-node)")
    p.add_argument("--gpus-per-node", type=integer(1), default=1)
    p.add_argument("--bandwidth", type=parse_bandwidth, help="inter-node (default: 10gbit)")
    p.add_argument("--latency", type=parse_duration, default="25us", help="alpha per round")
    p.add_argument("--call-overhead", type=parse_duration, default="0s", help="per collective call")
    p.add_argument(
        "--intra-bandwidth", type=parse_bandwidth, help="inside a node (default: 200gbit)"
    )
    p.add_argument("--intra-latency", type=parse_duration, help="inside a node (default: 5us)")
    p.add_argument("--schedule", choices=w.SCHEDULES, default="ring")
    p.add_argument("--shared-medium", action="store_true", help="all workers share one limit")
    p.add_argument(
        "--burst", type=parse_size, help="token bucket depth (with --shared-medium; default: 0)"
    )
    p.add_argument("--host-bandwidth", type=parse_bandwidth, help="per-worker host limit")
    p.add_argument("--methods", help="comma list (default: all; hier-* with --gpus-per-node)")
    p.add_argument(
        "--ratio", type=number(0, inclusive=False, maximum=1), help="TopK density (default: 0.01)"
    )
    p.add_argument(
        "--value-bytes", type=number(0, inclusive=False), help="TopK bytes per value (default: 4)"
    )
    p.add_argument(
        "--index-bytes",
        type=number(0, inclusive=False),
        help="TopK bytes per index (default: packed; topk-sar int32)",
    )
    p.add_argument("--levels", type=integer(1, MAX_QSGD_LEVELS), help="QSGD levels (default: 4)")
    p.add_argument("--rank", type=integer(1), help="PowerSGD rank (default: 4)")
    p.add_argument(
        "--overhead-ms",
        type=_overhead_items,
        action="append",
        help="METHOD=MS,... (may be repeated; each method once)",
    )
    p.add_argument("--overlap", choices=w.OVERLAPS, default="none")
    p.add_argument("--sweep", action="store_true", help=f"P = 2..1024 at {SWEEP_BANDWIDTHS}")
    p.add_argument("--sweep-bandwidths", help=f"with --sweep (default: {SWEEP_BANDWIDTHS})")
    p.add_argument("--plot", help=f"with --sweep: PNG path (default: {PLOT})")
    return p


def _check_plot(p: argparse.ArgumentParser, path: str) -> None:
    """A ``.png`` path whose folder exists or can be made (checked before the sweep runs)."""
    if not path.lower().endswith(".png"):
        p.error(f"--plot {path!r}: expected a .png path")
    if os.path.isdir(path):
        p.error(f"--plot {path!r}: is a folder; expected a .png path")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"--plot {path!r}: cannot write under {parent!r}")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Options against each other (each error names its options and values through
    ``p.error``); defaults filled in; ``args.method_list``, ``args.model_layers``,
    ``args.bandwidth_list`` (``--sweep``) set."""
    g = args.gpus_per_node
    if args.workers is not None and args.nodes is not None:
        p.error("give --workers or --nodes, not both")
    if args.sweep:
        for option, value in (("--workers", args.workers), ("--nodes", args.nodes)):
            if value is not None:
                p.error(f"--sweep varies P over 2..1024: drop {option} {value}")
        if args.bandwidth is not None:
            p.error("--sweep takes its bandwidths from --sweep-bandwidths: drop --bandwidth")
        if g > SWEEP_WORKERS[-1]:
            p.error(f"--gpus-per-node {g} with --sweep: no P in 2..1024 is a multiple of {g}")
    else:
        for option, value in (("--sweep-bandwidths", args.sweep_bandwidths), ("--plot", args.plot)):
            if value is not None:
                p.error(f"{option} {value!r} has no effect without --sweep: add --sweep or drop it")
        if args.workers is None and args.nodes is None:
            p.error("give --workers (P) or --nodes (with --gpus-per-node)")
    if args.workers is not None and g > 1:
        p.error(
            f"--workers {args.workers} counts one-GPU nodes; with --gpus-per-node {g} give "
            f"--nodes (P = nodes x {g})"
        )
    if g == 1:
        for option, value in (
            ("--intra-bandwidth", args.intra_bandwidth),
            ("--intra-latency", args.intra_latency),
        ):
            if value is not None:
                p.error(f"{option} sets the link inside a node: it needs --gpus-per-node > 1")
    if args.burst is not None and args.burst > 0 and not args.shared_medium:
        p.error(
            f"--burst ({args.burst:,.0f} bytes, a token bucket's depth) applies only to a "
            "shared medium: add --shared-medium or drop --burst"
        )
    if args.methods is None:
        args.methods = default_methods(g)
    try:
        bases = {name.removeprefix("hier-") for name in method_names(args.methods)}
    except ValueError as error:
        p.error(f"--methods: {error}")
    for dest, (default, users) in METHOD_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
        elif not bases & set(users):
            option = "--" + dest.replace("_", "-")
            p.error(
                f"{option} {getattr(args, dest):g} has no effect: it applies to "
                f"{' and '.join(users)}, not among --methods {args.methods!r}"
            )
    try:
        args.method_list = make_methods(args)
    except ValueError as error:  # already checked by each option's type; a backstop
        p.error(f"--methods {args.methods!r}: {error}")
    try:
        overheads = _merge_overheads(args.overhead_ms or [])
    except ValueError as error:
        p.error(f"--overhead-ms: {error}")
    names = [m.name for m in args.method_list]
    for name in overheads:
        if name not in names:
            p.error(f"--overhead-ms: {name!r} is not among --methods {args.methods!r}")
    args.overhead_ms = overheads
    if args.sweep:
        text = SWEEP_BANDWIDTHS if args.sweep_bandwidths is None else args.sweep_bandwidths
        args.sweep_bandwidths = [b for b in (b.strip() for b in text.split(",")) if b]
        if not args.sweep_bandwidths:
            p.error(f"--sweep-bandwidths {text!r}: expected a comma list, e.g. {SWEEP_BANDWIDTHS}")
        try:
            args.bandwidth_list = [parse_bandwidth(b) for b in args.sweep_bandwidths]
        except ValueError as error:
            p.error(f"--sweep-bandwidths {text!r}: {error} (a comma list)")
        for i, bandwidth in enumerate(args.bandwidth_list):
            if bandwidth in args.bandwidth_list[:i]:
                p.error(f"--sweep-bandwidths {text!r}: {args.sweep_bandwidths[i]!r} repeats")
        args.plot = PLOT if args.plot is None else args.plot
        _check_plot(p, args.plot)
    for dest, parse, default in (
        ("bandwidth", parse_bandwidth, "10gbit"),
        ("intra_bandwidth", parse_bandwidth, "200gbit"),
        ("intra_latency", parse_duration, "5us"),
        ("burst", parse_size, "0"),
    ):
        if getattr(args, dest) is None:
            setattr(args, dest, parse(default))
    if args.layers is not None:
        try:
            args.model_layers = load_layers(args.layers)
        except (OSError, ValueError) as error:
            p.error(f"--layers {args.layers!r}: {error}")
    else:
        args.model_layers = None
    return args


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


def keras_layers(name: str) -> w.Layers:
    """The trainable tensor shapes of a ``keras.applications`` model (built without weights:
    nothing is downloaded)."""
    import keras

    model = getattr(keras.applications, KERAS_MODELS[name])(weights=None)
    return w.Layers(tuple(tuple(v.shape) for v in model.trainable_variables))


def layers_of(args: argparse.Namespace) -> w.Layers:
    if getattr(args, "model_layers", None) is not None:  # --layers, loaded by check_args
        return args.model_layers
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
    rows = [("method", "inter-node bytes", "comm ms", "step ms", "x dense")]
    for p in predictions:
        speedup = f"{dense / p.step:.2f}" if dense and p.step else "-"
        rows.append(
            (
                p.method,
                f"{p.bytes_sent:,.0f}",
                f"{1e3 * p.comm:.1f}",
                f"{1e3 * p.step:.1f}",
                speedup,
            )
        )
    head, *body = columns(rows, (16, 19, 11, 11, 9), left=1)
    best = w.winner(predictions)
    lines = [head, "-" * len(head), *body]
    lines.append(f"winner: {best.method} ({1e3 * best.step:.1f} ms/step)")
    return "\n".join(lines)


def columns(rows: Sequence[Sequence[str]], widths: Sequence[int], left: int = 0) -> list[str]:
    """``rows`` of cells as lines, the first ``left`` columns left-aligned, the others
    right-aligned; a column is ``widths``' width, or wider where a cell needs it, so that two
    cells are always at least two spaces apart."""
    fit = [max(width, 2 + max(len(row[i]) for row in rows)) for i, width in enumerate(widths)]
    return [
        "".join(
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, fit, strict=True))
        )
        for row in rows
    ]


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
    names, bandwidths = args.sweep_bandwidths, args.bandwidth_list  # set by check_args
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
    try:
        plot_sweep(names, bandwidths, results, args.plot)
    except OSError as error:
        raise ValueError(f"--plot {args.plot!r}: {error}") from error
    print(f"wrote {args.plot}")


def sweep_table(names: Sequence[str], bandwidths: Sequence[float], results: dict) -> str:
    """At powers of two, a column per bandwidth: the winner, its ms/step and dense's."""
    powers = [p for p in results[bandwidths[0]] if p & (p - 1) == 0]
    rows = [["P", *(f"{n}: winner ms (dense ms)" for n in names)]]
    for p in powers:
        cells = [str(p)]
        for bandwidth in bandwidths:
            predictions = results[bandwidth][p]
            best = w.winner(predictions)
            dense = next((x.step for x in predictions if x.method == "dense"), math.nan)
            cells.append(f"{best.method} {1e3 * best.step:.0f} ({1e3 * dense:.0f})")
        rows.append(cells)
    return "\n".join(columns(rows, (6, *(34 for _ in names))))


def plot_sweep(names: Sequence[str], bandwidths: Sequence[float], results: dict, path: str) -> None:
    """ms/step against P, a line per method, a panel per bandwidth (PNG)."""
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
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)


def main(argv: Sequence[str]) -> int:
    """0, or argparse's exit (``SystemExit(2)``, the message on stderr) on bad options."""
    parser = build_parser()
    args = check_args(parser, parser.parse_args(argv))
    try:
        (run_sweep if args.sweep else run_once)(args, args.method_list, layers_of(args))
    except (ValueError, OSError) as error:  # options are checked above: a backstop
        parser.error(str(error))
    return 0
