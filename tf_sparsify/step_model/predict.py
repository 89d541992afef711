"""The what-if's predictions: each method's step time on a cluster, sweeps over bandwidth and
worker count, the winners, and the TopK/dense crossover in closed form.

A step is ``compute`` (forward, backward, optimizer) and ``overhead`` (the compressor's own work:
select, encode, decode; measured, an input; it never hides) and the exchange on one link queue.
Each tensor is a unit: its exchange ``c_i`` is the model's :func:`comm_time` split in proportion
to the tensor's own exchange time (:func:`unit_comms`). Forward takes ``(1 - b) compute``, then
backward ``b compute`` (``b = backward_fraction``) fills the tensors from the last to the first in
proportion to their sizes. The queue sends the late units (``late_buckets``: none, the first
tensor's or all) first from time 0, then the others from the last tensor to the first, each from
the later of the link free and its earliest start (``overlap``): after the step's compute
(``none``), when backward has made it ready (``backprop``), or at once (``full``). The step is
``overhead + max(compute, link free)``: ``overhead + compute + comm`` with ``none``,
``overhead + max(compute, comm)`` with ``full`` or every unit late. The workers run in lockstep
with no skew, so the wait for the slowest rank, which a late unit also hides, is not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tf_sparsify.common.checks import check_int, check_number
from tf_sparsify.step_model.methods import Method
from tf_sparsify.step_model.network import Cluster, Transfer, check_choice, link_time
from tf_sparsify.step_model.shapes import Layers

Overlap = Literal["none", "backprop", "full"]
OVERLAPS = ("none", "backprop", "full")
Late = Literal["none", "last", "all"]
#: what travels one step late (``ExchangeOptions.late_buckets``): nothing, the last bucket
#: backprop fills (the first layers'; the first tensor's in the model), or everything
LATE_BUCKETS = ("none", "last", "all")
#: the share of a step's compute that is the backward pass (the rest is the forward pass)
BACKWARD_FRACTION = 2 / 3


def comm_time(method: Method, layers: Layers, cluster: Cluster) -> float:
    """Seconds of one step's exchange: the time on each link level, added (levels run in turn)."""
    return transfers_time(method.transfers(layers, cluster), cluster)


def transfers_time(transfers: Sequence[Transfer], cluster: Cluster) -> float:
    """Seconds of these collectives: the time on each link level, added (levels run in turn)."""
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


def unit_comms(method: Method, layers: Layers, cluster: Cluster) -> list[float]:
    """Seconds of each tensor's exchange: :func:`comm_time` of the model split in proportion to
    each tensor's own exchange time, so that they add up to the model's."""
    alone = {s: comm_time(method, Layers((s,)), cluster) for s in set(layers.shapes)}
    times = [alone[s] for s in layers.shapes]
    total, whole = comm_time(method, layers, cluster), sum(times)
    return [total * t / whole if whole else total / len(times) for t in times]


def _check_timeline(overlap: str, late_buckets: str, backward_fraction: float) -> float:
    """``backward_fraction`` as a float, once ``overlap`` and ``late_buckets`` are known values."""
    check_choice("overlap", overlap, OVERLAPS)
    check_choice("late_buckets", late_buckets, LATE_BUCKETS)
    return check_number("backward_fraction", backward_fraction, 0, 1, low_open=True)


def _ready_times(compute: float, sizes: Sequence[float], backward: float) -> list[float]:
    """When backprop has made each unit's gradient: ``compute - b compute * sum(sizes[:i]) /
    sum(sizes)`` (the first unit's at ``compute``, the last's earliest)."""
    total, before, out = sum(sizes), 0.0, []
    for size in sizes:
        out.append(compute - backward * compute * before / total)
        before += size
    return out


def _link_free(comms: Sequence[float], starts: Sequence[float], late: Sequence[bool]) -> float:
    """When one link queue has sent every unit: the late ones from 0 in order, then the others
    from the last to the first, each from the later of its start and the link free."""
    n, free = len(comms), 0.0
    order = [i for i in range(n) if late[i]] + [i for i in reversed(range(n)) if not late[i]]
    for i in order:
        free = max(0.0 if late[i] else starts[i], free) + comms[i]
    return free


def step_time(
    compute: float,
    overhead: float,
    comm: float | Sequence[float],
    overlap: Overlap = "none",
    late_buckets: Late = "none",
    sizes: Sequence[float] | None = None,
    backward_fraction: float = BACKWARD_FRACTION,
) -> float:
    """``overhead + max(compute, link free)`` for ``comm`` seconds of exchange, or one entry per
    unit (first layer's first) with their element counts ``sizes`` (None: equal sizes)."""
    backward = _check_timeline(overlap, late_buckets, backward_fraction)
    comms = list(comm) if isinstance(comm, Sequence) else [comm]
    sizes = [1.0] * len(comms) if sizes is None else sizes
    if not comms or len(sizes) != len(comms):
        raise ValueError(
            f"`sizes` must hold one entry per unit of `comm` ({len(comms)}); got {len(sizes)}"
        )
    if overlap == "backprop":
        starts = _ready_times(compute, sizes, backward)
    else:
        starts = [compute if overlap == "none" else 0.0] * len(comms)
    late = [late_buckets == "all" or (late_buckets == "last" and i == 0) for i in range(len(comms))]
    return overhead + max(compute, _link_free(comms, starts, late))


def _one_unit(overlap: str, late_buckets: str) -> bool:
    """Whether every unit starts together, so that only the whole exchange matters."""
    return late_buckets == "all" or overlap == "full" or (overlap, late_buckets) == ("none",) * 2


def predict(
    methods: Sequence[Method],
    layers: Layers,
    cluster: Cluster,
    compute: float,
    overheads: Mapping[str, float] | None = None,
    overlap: Overlap = "none",
    *,
    late_buckets: Late = "none",
    backward_fraction: float = BACKWARD_FRACTION,
) -> list[Prediction]:
    """Predicted step of each method (in order) from ``compute`` seconds per step and each
    method's measured ``overheads[name]`` seconds (0 where absent)."""
    compute = check_number("compute", compute, low=0)
    _check_timeline(overlap, late_buckets, backward_fraction)
    sizes = None if _one_unit(overlap, late_buckets) else layers.sizes
    overheads = dict(overheads or {})
    unknown = set(overheads) - {m.name for m in methods}
    if unknown:
        raise ValueError(f"`overheads` names methods not predicted: {sorted(unknown)}")
    out = []
    for method in methods:
        extra = check_number(f"overheads[{method.name!r}]", overheads.get(method.name, 0.0), low=0)
        comm = comm_time(method, layers, cluster)
        comms = comm if sizes is None else unit_comms(method, layers, cluster)
        step = step_time(compute, extra, comms, overlap, late_buckets, sizes, backward_fraction)
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
    *,
    late_buckets: Late = "none",
    backward_fraction: float = BACKWARD_FRACTION,
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
            out[bandwidth][p] = predict(
                methods,
                layers,
                sized,
                compute,
                overheads,
                overlap,
                late_buckets=late_buckets,
                backward_fraction=backward_fraction,
            )
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
