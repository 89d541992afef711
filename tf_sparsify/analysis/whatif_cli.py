"""``python -m tf_sparsify whatif``: predicted ms/step of each exchange method, and the winner.

    python -m tf_sparsify whatif --compute-ms 120 --params 25M --workers 16 --bandwidth 10gbit
    python -m tf_sparsify whatif --compute-ms 120 --model mlp10m --nodes 8 --gpus-per-node 8 \\
        --bandwidth 25gbit --latency 20us --overhead-ms topk=8,topk-sar=10
    python -m tf_sparsify whatif --compute-ms 120 --layers shapes.json --sweep --plot sweep.png

``--layers`` takes the path of a JSON file holding a list of tensor shapes (``[[784, 2048],
[2048], ...]``) or sizes (``[1605632, 2048]``, each a vector). The model is in
:mod:`tf_sparsify.analysis.whatif`; the options are declared and checked in
:mod:`~tf_sparsify.analysis.whatif_cli_options` (their values parsed in
:mod:`~tf_sparsify.analysis.whatif_cli_values`); the output is
:mod:`~tf_sparsify.analysis.whatif_cli_tables` and :mod:`~tf_sparsify.analysis.whatif_cli_plot`.
This module runs them, and gathers their public names.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from tf_sparsify.analysis.whatif_cli_auto import run_auto
from tf_sparsify.analysis.whatif_cli_options import (
    FLAT_METHODS,
    KERAS_MODELS,
    METHOD_OPTIONS,
    MODELS,
    PLOT,
    SWEEP_BANDWIDTHS,
    SWEEP_WORKERS,
    build_parser,
    check_args,
    default_methods,
    load_layers,
    make_methods,
    method_names,
    parse_args,
)
from tf_sparsify.analysis.whatif_cli_plot import plot_sweep
from tf_sparsify.analysis.whatif_cli_tables import columns, sweep_table, table
from tf_sparsify.analysis.whatif_cli_values import (
    MAX_PARAMS,
    OptionError,
    integer,
    number,
    parse_bandwidth,
    parse_count,
    parse_duration,
    parse_overheads,
    parse_size,
)
from tf_sparsify.step_model.methods import Method
from tf_sparsify.step_model.network import Cluster, Link
from tf_sparsify.step_model.predict import predict, sweep, winner_ranges
from tf_sparsify.step_model.shapes import MLP10M, Layers

__all__ = [
    "FLAT_METHODS",
    "KERAS_MODELS",
    "MAX_PARAMS",
    "METHOD_OPTIONS",
    "MODELS",
    "PLOT",
    "SWEEP_BANDWIDTHS",
    "SWEEP_WORKERS",
    "OptionError",
    "build_parser",
    "check_args",
    "cluster_of",
    "columns",
    "default_methods",
    "integer",
    "keras_layers",
    "layers_of",
    "load_layers",
    "main",
    "make_methods",
    "method_names",
    "number",
    "parse_args",
    "parse_bandwidth",
    "parse_count",
    "parse_duration",
    "parse_overheads",
    "parse_size",
    "plot_sweep",
    "run_once",
    "run_sweep",
    "sweep_table",
    "table",
]


def keras_layers(name: str) -> Layers:
    """The trainable tensor shapes of a ``keras.applications`` model (built without weights:
    nothing is downloaded)."""
    import keras

    model = getattr(keras.applications, KERAS_MODELS[name])(weights=None)
    return Layers(tuple(tuple(v.shape) for v in model.trainable_variables))


def layers_of(args: argparse.Namespace) -> Layers:
    if getattr(args, "model_layers", None) is not None:  # --layers, loaded by check_args
        return args.model_layers
    if args.layers:
        return load_layers(args.layers)
    if args.model:
        return MLP10M if args.model == "mlp10m" else keras_layers(args.model)
    return Layers.from_params(args.params)


def cluster_of(args: argparse.Namespace, nodes: int | None = None) -> Cluster:
    """The cluster of the arguments (``nodes`` overrides ``--workers`` / ``--nodes``)."""
    link = Link(
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
    intra = Link(args.intra_bandwidth, args.intra_latency)
    return Cluster(nodes, link, args.gpus_per_node, intra, args.schedule)


def _overlap_text(args: argparse.Namespace) -> str:
    """``overlap X`` of the header line, and ``late buckets Y`` when some are late."""
    late = f", late buckets {args.late_buckets}" if args.late_buckets != "none" else ""
    return f"overlap {args.overlap}{late}"


def run_once(args: argparse.Namespace, methods: list[Method], layers: Layers) -> None:
    cluster = cluster_of(args)
    predictions = predict(
        methods,
        layers,
        cluster,
        args.compute_ms / 1e3,
        args.overhead_ms,
        args.overlap,
        late_buckets=args.late_buckets,
    )
    shape = f" ({cluster.nodes} x {cluster.gpus_per_node})" if cluster.gpus_per_node > 1 else ""
    print(
        f"{layers.num_params:,} parameters, P = {cluster.workers}{shape}, "
        f"{8 * args.bandwidth / 1e9:g} Gbit/s, alpha {1e6 * args.latency:g} us, "
        f"compute {args.compute_ms:g} ms, {_overlap_text(args)}, {args.schedule} schedule"
    )
    print(table(predictions))
    if args.auto:
        print(run_auto(args, layers, cluster))


def run_sweep(args: argparse.Namespace, methods: list[Method], layers: Layers) -> None:
    """Winner ranges and a table at powers of two for each bandwidth; the plot."""
    names, bandwidths = args.sweep_bandwidths, args.bandwidth_list  # set by check_args
    g = args.gpus_per_node
    workers = [p for p in SWEEP_WORKERS if p % g == 0]
    cluster = cluster_of(args, nodes=1)
    compute = args.compute_ms / 1e3
    results = sweep(
        methods,
        layers,
        cluster,
        compute,
        bandwidths,
        workers,
        args.overhead_ms,
        args.overlap,
        late_buckets=args.late_buckets,
    )
    print(
        f"{layers.num_params:,} parameters, compute {args.compute_ms:g} ms, "
        f"alpha {1e6 * args.latency:g} us, {g} per node, {_overlap_text(args)}"
    )
    for name, bandwidth in zip(names, bandwidths, strict=True):
        ranges = winner_ranges(results[bandwidth])
        print(f"{name}: " + "; ".join(f"P {a}-{b}: {m}" for a, b, m in ranges))
    print(sweep_table(names, bandwidths, results))
    try:
        plot_sweep(names, bandwidths, results, args.plot)
    except OSError as error:
        raise ValueError(f"--plot {args.plot!r}: {error}") from error
    print(f"wrote {args.plot}")


def main(argv: Sequence[str]) -> int:
    """0, or argparse's exit (``SystemExit(2)``, the message on stderr) on bad options."""
    parser = build_parser()
    args = check_args(parser, parser.parse_args(argv))
    try:
        (run_sweep if args.sweep else run_once)(args, args.method_list, layers_of(args))
    except (ValueError, OSError) as error:  # options are checked above: a backstop
        parser.error(str(error))
    return 0
