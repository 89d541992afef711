"""The what-if's predictions: each method's step time on a cluster, sweeps over bandwidth and
worker count, the winners, and the TopK/dense crossover in closed form.

A step is ``compute`` (forward, backward, optimizer) + ``overhead`` (the compressor's own work:
select, encode, decode; measured, an input) + ``comm`` (the exchange); with ``overlap="full"``
the step is ``overhead + max(compute, comm)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tf_sparsify.analysis.whatif_methods import Method
from tf_sparsify.analysis.whatif_network import Cluster, check_choice, link_time
from tf_sparsify.analysis.whatif_shapes import Layers
from tf_sparsify.common.checks import check_int, check_number

Overlap = Literal["none", "full"]
OVERLAPS = ("none", "full")


def comm_time(method: Method, layers: Layers, cluster: Cluster) -> float:
    """Seconds of one step's exchange: the time on each link level, added (levels run in turn)."""
    transfers = method.transfers(layers, cluster)
    levels = dict.fromkeys(t.level for t in transfers)
    return sum(
        link_time([t for t in transfers if t.level == lv], cluster.link(lv)) for lv in levels
    )


def bytes_sent(method: Method, layers: Layers, cluster: Cluster, level: str = "inter") -> float:
    """Bytes one worker (one node's link, for a hierarchical exchange) sends per step."""
    return sum(t.bytes_sent for t in method.transfers(layers, cluster) if t.level == level)


@dataclass(frozen=True)
class Prediction:
    """One method's predicted step, seconds, and the inter-node bytes sent per worker."""

    method: str
    compute: float
    overhead: float
    comm: float
    step: float
    bytes_sent: float


def step_time(compute: float, overhead: float, comm: float, overlap: Overlap = "none") -> float:
    """``none``: ``compute + overhead + comm``; ``full``: ``overhead + max(compute, comm)``
    (the compressor runs on the same processor as the model, so only the network hides)."""
    check_choice("overlap", overlap, OVERLAPS)
    return overhead + (compute + comm if overlap == "none" else max(compute, comm))


def predict(
    methods: Sequence[Method],
    layers: Layers,
    cluster: Cluster,
    compute: float,
    overheads: Mapping[str, float] | None = None,
    overlap: Overlap = "none",
) -> list[Prediction]:
    """Predicted step of each method (in order) from ``compute`` seconds per step and each
    method's measured ``overheads[name]`` seconds (0 where absent)."""
    compute = check_number("compute", compute, low=0)
    overheads = dict(overheads or {})
    unknown = set(overheads) - {m.name for m in methods}
    if unknown:
        raise ValueError(f"`overheads` names methods not predicted: {sorted(unknown)}")
    out = []
    for method in methods:
        extra = check_number(f"overheads[{method.name!r}]", overheads.get(method.name, 0.0), low=0)
        comm = comm_time(method, layers, cluster)
        step = step_time(compute, extra, comm, overlap)
        sent = bytes_sent(method, layers, cluster)
        out.append(Prediction(method.name, compute, extra, comm, step, sent))
    return out


def winner(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest prediction (the first of equals)."""
    return min(predictions, key=lambda p: p.step)


def crossover_workers(
    ratio: float, value_bytes: float = 4, index_bytes: float = 4, dense_bytes: float = 4
) -> float:
    """``P`` where TopK all-gather and dense ring all-reduce send equal bytes (no latency):
    ``(P - 1) k (v + i) = 2 (P - 1) / P * n d``, so ``P = 2 d / (ratio (v + i))`` (with
    ``k = ratio n``): 100 for 1% with fp32 values and int32 indices, 50 against 16-bit dense."""
    ratio, value_bytes, index_bytes, dense_bytes = (
        check_number(name, value, low=0, low_open=True)
        for name, value in (
            ("ratio", ratio),
            ("value_bytes", value_bytes),
            ("index_bytes", index_bytes),
            ("dense_bytes", dense_bytes),
        )
    )
    return 2 * dense_bytes / (ratio * (value_bytes + index_bytes))


def sweep(
    methods: Sequence[Method],
    layers: Layers,
    cluster: Cluster,
    compute: float,
    bandwidths: Sequence[float],
    workers: Sequence[int],
    overheads: Mapping[str, float] | None = None,
    overlap: Overlap = "none",
) -> dict[float, dict[int, list[Prediction]]]:
    """Predictions for each inter-node bandwidth (bytes/s) and worker count (a multiple of
    ``cluster.gpus_per_node``); everything else comes from ``cluster``."""
    g = cluster.gpus_per_node
    out: dict[float, dict[int, list[Prediction]]] = {}
    for bandwidth in bandwidths:
        link = replace(cluster.inter, bandwidth=bandwidth)
        out[bandwidth] = {}
        for p in workers:
            if check_int("workers", p) % g:
                raise ValueError(f"`workers` must be multiples of gpus_per_node={g}; got {p}")
            sized = replace(cluster, nodes=p // g, inter=link)
            out[bandwidth][p] = predict(methods, layers, sized, compute, overheads, overlap)
    return out


def winner_ranges(by_workers: Mapping[int, Sequence[Prediction]]) -> list[tuple[int, int, str]]:
    """``(first P, last P, method)`` for each run of worker counts with the same winner."""
    ranges: list[tuple[int, int, str]] = []
    for p, predictions in sorted(by_workers.items()):
        name = winner(predictions).method
        if ranges and ranges[-1][2] == name:
            ranges[-1] = (ranges[-1][0], p, name)
        else:
            ranges.append((p, p, name))
    return ranges
