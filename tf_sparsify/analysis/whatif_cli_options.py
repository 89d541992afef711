"""The options of ``python -m tf_sparsify whatif``: the parser, and the checks of the options
against each other (each error names its options and values through argparse's ``error``)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

from tf_sparsify.analysis.whatif_cli_auto import AUTO_RATIOS, auto_ratios
from tf_sparsify.analysis.whatif_cli_values import (
    MAX_PARAMS,
    integer,
    merge_overheads,
    number,
    overhead_items,
    parse_bandwidth,
    parse_count,
    parse_duration,
    parse_size,
)
from tf_sparsify.compressors.qsgd import MAX_LEVELS as MAX_QSGD_LEVELS
from tf_sparsify.step_model import methods
from tf_sparsify.step_model.link_fit import LinkMeasurement
from tf_sparsify.step_model.network import SCHEDULES
from tf_sparsify.step_model.predict import LATE_BUCKETS, OVERLAPS
from tf_sparsify.step_model.shapes import Layers

#: the first line of ``--help``
DESCRIPTION = (
    "``python -m tf_sparsify whatif``: predicted ms/step of each exchange method, and the winner."
)
SWEEP_BANDWIDTHS = "1gbit,10gbit,100gbit"
SWEEP_WORKERS = range(2, 1025)
PLOT = "outputs/whatif_sweep.png"
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
#: options left None by the parser when not given: their defaults, filled in by check_args
LINK_DEFAULTS = (
    ("bandwidth", parse_bandwidth, "10gbit"),
    ("intra_bandwidth", parse_bandwidth, "200gbit"),
    ("intra_latency", parse_duration, "5us"),
    ("burst", parse_size, "0"),
)


def load_layers(path: str) -> Layers:
    """Shapes from the JSON file at ``path``: a list of shapes or sizes."""
    with open(path) as f:
        items = json.load(f)
    if not isinstance(items, list):
        raise ValueError("expected a JSON list of shapes or sizes")
    layers = Layers(tuple(tuple(i) if isinstance(i, list) else (i,) for i in items))
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


def make_methods(args: argparse.Namespace) -> list[methods.Method]:
    """The methods named in ``--methods`` (``hier-X``: X across nodes, dense inside)."""
    topk = {"ratio": args.ratio, "value_bytes": args.value_bytes, "index_bytes": args.index_bytes}
    flat = {
        "dense": lambda: methods.DenseAllReduce(4, "dense"),
        "fp16": lambda: methods.DenseAllReduce(2, "fp16"),
        "topk": lambda: methods.TopKAllGather(**topk),
        "topk-sar": lambda: methods.TopKSplitReduce(**topk),
        "qsgd": lambda: methods.QSGDAllGather(args.levels),
        "powersgd": lambda: methods.PowerSGDAllReduce(args.rank),
    }
    out: list[methods.Method] = []
    for name in method_names(args.methods):
        base = name.removeprefix("hier-")
        out.append(flat[base]() if base == name else methods.Hierarchical(flat[base]()))
    return out


def default_methods(gpus_per_node: int) -> str:
    base = ",".join(FLAT_METHODS)
    return base + (",hier-topk,hier-topk-sar" if gpus_per_node > 1 else "")


def build_parser() -> argparse.ArgumentParser:
    """The options; a default of None marks an option whose use :func:`check_args` checks
    against the others (given where it has no effect: an error), filled in there."""
    p = argparse.ArgumentParser(
        prog="python -m tf_sparsify whatif",
        description=DESCRIPTION,
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
    p.add_argument("--schedule", choices=SCHEDULES, default="ring")
    p.add_argument("--shared-medium", action="store_true", help="all workers share one limit")
    p.add_argument(
        "--burst", type=parse_size, help="token bucket depth (with --shared-medium; default: 0)"
    )
    p.add_argument(
        "--link",
        help="a link measured by `python -m tf_sparsify probe-link --out FILE` (JSON): its "
        "bandwidth and per-call cost, and its worker count unless --workers is given",
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
        type=overhead_items,
        action="append",
        help="METHOD=MS,... (may be repeated; each method once)",
    )
    p.add_argument(
        "--overlap",
        choices=OVERLAPS,
        default="none",
        help="when the exchange may run: after compute, as backprop makes each tensor, or at once",
    )
    p.add_argument(
        "--late-buckets",
        choices=LATE_BUCKETS,
        default="none",
        help="tensors exchanged one step late, while the next step computes: the first or all",
    )
    p.add_argument(
        "--auto",
        action="store_true",
        help="also what Auto would send each tensor with: dense, FP16 or TopK (--auto-ratios)",
    )
    p.add_argument("--auto-ratios", type=auto_ratios, help=f"with --auto (default: {AUTO_RATIOS})")
    p.add_argument(
        "--host-work",
        action="store_true",
        help="with --auto and a --link measured with CPU times: the step computes on the cores "
        "the exchange's copies and sums use, so Auto counts that work as compute",
    )
    p.add_argument("--sweep", action="store_true", help=f"P = 2..1024 at {SWEEP_BANDWIDTHS}")
    p.add_argument("--sweep-bandwidths", help=f"with --sweep (default: {SWEEP_BANDWIDTHS})")
    p.add_argument("--plot", help=f"with --sweep: PNG path (default: {PLOT})")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Options against each other (each error names its options and values through
    ``p.error``); defaults filled in; ``args.method_list``, ``args.model_layers``,
    ``args.bandwidth_list`` (``--sweep``) set."""
    _read_link(p, args)
    _check_cluster(p, args)
    _check_methods(p, args)
    _check_auto(p, args)
    if args.sweep:
        _check_sweep_bandwidths(p, args)
        args.plot = PLOT if args.plot is None else args.plot
        _check_plot(p, args.plot)
    for dest, parse, default in LINK_DEFAULTS:
        if getattr(args, dest) is None:
            setattr(args, dest, parse(default))
    args.model_layers = None
    if args.layers is not None:
        try:
            args.model_layers = load_layers(args.layers)
        except (OSError, ValueError) as error:
            p.error(f"--layers {args.layers!r}: {error}")
    return args


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = build_parser()
    return check_args(p, p.parse_args(argv))


def _check_cluster(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The worker counts against ``--sweep``, and the link options against what they shape."""
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


def _check_methods(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--methods``, the method options (each must shape one of them) and ``--overhead-ms``
    (each method once, among them); sets ``args.method_list`` and ``args.overhead_ms``."""
    if args.methods is None:
        args.methods = default_methods(args.gpus_per_node)
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
        overheads = merge_overheads(args.overhead_ms or [])
    except ValueError as error:
        p.error(f"--overhead-ms: {error}")
    names = [m.name for m in args.method_list]
    for name in overheads:
        if name not in names:
            p.error(f"--overhead-ms: {name!r} is not among --methods {args.methods!r}")
    args.overhead_ms = overheads


def _read_link(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--link``'s measurement into ``--bandwidth``, ``--call-overhead`` (the fitted cost of a
    call includes its rounds: ``--latency`` 0) and ``--workers`` where not given."""
    args.link_host = None
    if args.link is None:
        return
    for option, given in (("--bandwidth", args.bandwidth), ("--nodes", args.nodes)):
        if given is not None:
            p.error(f"--link gives the measured link: drop {option}")
    try:
        with open(args.link) as f:
            measured = LinkMeasurement.from_json(f.read())
    except (OSError, ValueError, TypeError) as error:
        p.error(f"--link {args.link!r}: {error}")
    link, args.link_host = measured.link(), measured.host()
    args.bandwidth, args.call_overhead, args.latency = link.bandwidth, link.call_overhead, 0.0
    args.workers = measured.workers if args.workers is None else args.workers


def _check_auto(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--auto`` predicts one cluster (not ``--sweep``); ``--auto-ratios`` and ``--host-work``
    only with it; sets ``args.auto_ratio_list``."""
    if args.auto and args.sweep:
        p.error("--auto chooses for one cluster: drop --sweep, or --auto")
    if args.auto_ratios is not None and not args.auto:
        p.error("--auto-ratios applies only with --auto")
    if args.host_work and not (args.auto and args.link_host):
        p.error(
            "--host-work needs --auto and a --link measured with CPU times (cpu_seconds, as "
            f"`probe-link` writes them); got --auto {args.auto}, --link {args.link!r}"
        )
    args.auto_ratio_list = args.auto_ratios or auto_ratios(AUTO_RATIOS)


def _check_sweep_bandwidths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--sweep-bandwidths`` as ``args.sweep_bandwidths`` (the names) and
    ``args.bandwidth_list`` (bytes/s): at least one, each once."""
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
