"""Network what-if: predicted step time of each exchange method from alpha-beta cost models.

A step is ``compute`` (forward, backward, optimizer) + ``overhead`` (the compressor's own work:
select, encode, decode; measured, an input) + ``comm`` (the exchange); with ``overlap="full"``
the step is ``overhead + max(compute, comm)``. The exchange is a sequence of collectives; each
costs ``c + rounds * alpha + bytes_sent * beta`` (Hockney's model plus a per-call cost ``c``):
``rounds`` message rounds on the critical path, ``alpha`` seconds per round, ``bytes_sent`` what
one worker puts on its link, ``beta = 1 / bandwidth``. Links are full duplex and every collective
here is symmetric (a worker receives what it sends), so the bytes sent set the time. With ``P``
workers, ``m`` payload bytes per worker and ``R(P) = P - 1`` (``schedule="ring"``: Gloo, Horovod,
NCCL's ring) or ``ceil(log2 P)`` (``"logarithmic"``: recursive halving/doubling, Bruck; the same
bytes in fewer rounds):

- all-reduce (reduce-scatter, then all-gather of ``m / P`` slices):
  ``2 R(P) alpha + 2 (P - 1) / P * m * beta``, flat in ``P``.
- all-gather (every worker receives every payload): ``R(P) alpha + (P - 1) m beta``, linear
  in ``P``.
- all-to-all (pairwise, ``P - 1`` rounds under either schedule; a worker sends ``m / P`` to each
  other owner): ``(P - 1) alpha + (P - 1) / P * m * beta``.

Methods (``n`` parameters, ``k`` entries sent, ``v`` value and ``i`` index bytes per entry):

- :class:`DenseAllReduce`: fp32 (``v = 4``) or FP16/BF16 (``v = 2``), summable: all-reduce of
  ``n v`` bytes.
- :class:`TopKAllGather`: ``k v`` bytes of values and the packed index code of
  :class:`tf_sparsify.TopK` (Elias-Fano, about ``k (2 + log2(n / k))`` bits) per worker, or
  ``k i`` bytes of indices when ``index_bytes`` is given; gathered (the supports differ).
- :class:`TopKSplitReduce`: split-and-reduce (Ok-Topk style): all-to-all of the ``k`` entries to
  the owners of their index slices, each owner re-selects ``k / P`` entries of its sum,
  all-gather of those: ``2 (P - 1) / P * k (v + i)`` bytes, flat in ``P`` (indices assumed
  spread evenly over the slices).
- :class:`QSGDAllGather`: a signed level per entry (int8 up to 127 levels, else int16) and a
  float32 norm per bucket, gathered (not summable).
- :class:`PowerSGDAllReduce`: rank ``r``; a tensor of 2+ dimensions is a matrix ``a x b`` (``b``
  its last dimension, as :class:`tf_sparsify.PowerSGD`); where ``r (a + b) < a b`` it sends
  float32 factors ``P (a x r)`` and ``Q (b x r)``: two all-reduces in sequence, ``4 r sum(a)``
  bytes (with the dense tensors) then ``4 r sum(b)``, flat in ``P``.
- :class:`Hierarchical`: a dense fp32 all-reduce inside each node on the intra-node link
  (reduce-scatter, then all-gather of the result) and the inner method across the nodes on
  the inter-node link, each local rank carrying a shard, so a node's link carries one payload
  and the ``P`` of the compressed exchange is the number of nodes.

Flat methods on ``nodes x gpus_per_node`` run over all ``P`` workers on the inter-node link (on
the intra-node link when there is one node): a ring placed node by node crosses each node's link
with one flow per round; an all-to-all sends ``g (P - g) / P * m`` bytes from a node's ``g``
ranks to other nodes. ``Link.shared`` models one
medium for all workers (a loopback under ``tc``): the bytes of all ``P`` workers queue behind one
rate limit, less a token bucket's ``burst_bytes`` that refills while the step computes.
``Link.host_bandwidth`` caps what one worker can push (memory copies, kernel TCP); link and host
work as a pipeline, so the slower of the two sets the time.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

from tf_sparsify.compressors.powersgd import PowerSGD
from tf_sparsify.compressors.qsgd import QSGD
from tf_sparsify.compressors.topk import TopK
from tf_sparsify.ops.index_code import index_code_bytes

Schedule = Literal["ring", "logarithmic"]
Overlap = Literal["none", "full"]
SCHEDULES = ("ring", "logarithmic")
OVERLAPS = ("none", "full")
MAX_INT32_ELEMENTS = 2**31 - 1


# -- input checks ------------------------------------------------------------------------------
def _number(name: str, value: float, minimum: float = 0.0, inclusive: bool = True) -> float:
    """``value`` as a float if it is a finite real ``>= minimum`` (``>`` if not inclusive)."""
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < minimum or (not inclusive and value == minimum):
        relation = ">=" if inclusive else ">"
        raise ValueError(f"`{name}` must be a finite number {relation} {minimum}; got {value!r}")
    return float(value)


def _integer(name: str, value: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}; got {value!r}")
    return value


def _choice(name: str, value: str, allowed: Sequence[str]) -> str:
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {tuple(allowed)}; got {value!r}")
    return value


# -- the network -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """A link: ``bandwidth`` bytes/s (``math.inf``: no limit), ``latency`` seconds per message
    round (alpha).

    ``shared``: one medium for all workers of a collective (their bytes add up);
    ``burst_bytes``: a token bucket's depth, sent at once after the compute phase (only with
    ``shared``: the bucket is the one medium's limit, so nonzero on an unshared link is an error);
    ``host_bandwidth``: bytes/s one worker's host can push (``math.inf``: no limit);
    ``call_overhead``: seconds per collective call whatever ``P`` (framework software:
    negotiation, fusion buffers, launch), on top of ``latency`` per round.
    """

    bandwidth: float
    latency: float = 0.0
    shared: bool = False
    burst_bytes: float = 0.0
    host_bandwidth: float = math.inf
    call_overhead: float = 0.0

    def __post_init__(self):
        for name in ("bandwidth", "host_bandwidth"):
            if getattr(self, name) != math.inf:
                _number(name, getattr(self, name), inclusive=False)
        _number("latency", self.latency)
        _number("burst_bytes", self.burst_bytes)
        if self.burst_bytes and not self.shared:
            raise ValueError(
                "`burst_bytes` (a token bucket's depth) applies only to a shared medium "
                f"(`shared=True`); got burst_bytes={self.burst_bytes!r} with shared=False"
            )
        _number("call_overhead", self.call_overhead)


@dataclass(frozen=True)
class Cluster:
    """``nodes x gpus_per_node`` workers; ``inter`` joins nodes, ``intra`` the GPUs of a node."""

    nodes: int
    inter: Link
    gpus_per_node: int = 1
    intra: Link | None = None
    schedule: Schedule = "ring"

    def __post_init__(self):
        _integer("nodes", self.nodes)
        _integer("gpus_per_node", self.gpus_per_node)
        _choice("schedule", self.schedule, SCHEDULES)
        if self.gpus_per_node > 1 and self.intra is None:
            raise ValueError("`intra` (the intra-node Link) is needed when gpus_per_node > 1")

    @property
    def workers(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flat_level(self) -> str:
        """Where a collective over all workers runs: inside the node when there is one node
        of several GPUs, else across nodes."""
        return "intra" if self.nodes == 1 and self.gpus_per_node > 1 else "inter"

    def link(self, level: str) -> Link:
        return self.inter if level == "inter" else self.intra


# -- collectives -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    """One collective: ``rounds`` of latency, ``bytes_sent`` by one worker (or one node's link),
    among ``workers`` participants, on the ``"inter"`` or ``"intra"`` link."""

    level: str
    workers: int
    rounds: int
    bytes_sent: float


def phase_rounds(workers: int, schedule: Schedule) -> int:
    """Rounds of one all-gather or reduce-scatter phase: ``P - 1`` (ring), ``ceil(log2 P)``."""
    return workers - 1 if schedule == "ring" else math.ceil(math.log2(workers))


def all_reduce(size: float, workers: int, schedule: Schedule, level: str = "inter") -> Transfer:
    """``2 R(P)`` rounds, ``2 (P - 1) / P * size`` bytes sent per worker."""
    sent = 2 * (workers - 1) / workers * size
    return Transfer(level, workers, 2 * phase_rounds(workers, schedule), sent)


def all_gather(size: float, workers: int, schedule: Schedule, level: str = "inter") -> Transfer:
    """``R(P)`` rounds, ``(P - 1) * size`` bytes sent per worker (its payload to each other)."""
    return Transfer(level, workers, phase_rounds(workers, schedule), (workers - 1) * size)


def all_to_all(size: float, workers: int, level: str = "inter", per_node: int = 1) -> Transfer:
    """Pairwise: ``P - 1`` rounds; a node's ``g`` ranks send ``g (P - g) / P * size`` off-node."""
    sent = per_node * (workers - per_node) / workers * size
    return Transfer(level, workers, workers - 1, sent)


# -- the model's tensors -----------------------------------------------------------------------
@dataclass(frozen=True)
class Layers:
    """The shapes of a model's trainable tensors (each a tuple of positive ints)."""

    shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if not self.shapes:
            raise ValueError("`shapes` must hold at least one tensor shape")
        for shape in self.shapes:
            if not shape or any(
                isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape
            ):
                raise ValueError(f"`shapes` must hold tuples of integers >= 1; got {shape!r}")

    @classmethod
    def from_params(cls, num_params: int) -> Layers:
        """One tensor of ``num_params`` entries seen as a near-square matrix ``a x (n // a)``,
        ``a = isqrt(n)``, plus a vector of the remainder (what PowerSGD would factor)."""
        n = _integer("num_params", num_params)
        a = math.isqrt(n)
        rest = n - a * (n // a)
        return cls(((a, n // a),) + (((rest,),) if rest else ()))

    @property
    def sizes(self) -> list[int]:
        return [math.prod(shape) for shape in self.shapes]

    @property
    def num_params(self) -> int:
        return sum(self.sizes)


def mlp_layers(widths: Sequence[int]) -> Layers:
    """Kernels and biases of a dense MLP ``widths[0] -> ... -> widths[-1]``."""
    pairs = zip(widths[:-1], widths[1:], strict=False)
    return Layers(tuple(s for a, b in pairs for s in ((a, b), (b,))))


#: the benchmark's ``mlp10m``: 784 -> 2048 x 3 -> 10, 10.0M parameters
MLP10M = mlp_layers((784, 2048, 2048, 2048, 10))


# -- methods -----------------------------------------------------------------------------------
class Method(Protocol):
    name: str

    def payload_bytes(self, layers: Layers) -> float:
        """Bytes of one worker's compressed payload for the whole model."""

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        """The collectives of one step, in order."""


def topk_entries(size: int, ratio: float) -> int:
    """How many entries :class:`tf_sparsify.TopK` selects of ``size`` at ``ratio``."""
    return TopK(ratio=ratio).num_selected(size)


def _index_bytes(size: int, index_bytes: float | None) -> float:
    """int32 indices while they fit, int64 beyond, unless ``index_bytes`` says otherwise."""
    if index_bytes is not None:
        return index_bytes
    return 8 if size > MAX_INT32_ELEMENTS else 4


@dataclass(frozen=True)
class DenseAllReduce:
    """Summable dense payload of ``value_bytes`` per entry (4: fp32, 2: FP16/BF16); all-reduce."""

    value_bytes: float = 4
    name: str = "dense"

    def __post_init__(self):
        _number("value_bytes", self.value_bytes, inclusive=False)

    def payload_bytes(self, layers: Layers) -> float:
        return layers.num_params * self.value_bytes

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        p, level = cluster.workers, cluster.flat_level
        return [all_reduce(self.payload_bytes(layers), p, cluster.schedule, level)]


@dataclass(frozen=True)
class TopKAllGather:
    """TopK ``ratio`` per tensor, ``value_bytes`` per value and the packed index code (or
    ``index_bytes`` per index); all-gather."""

    ratio: float = 0.01
    value_bytes: float = 4
    index_bytes: float | None = None
    name: str = "topk"

    def __post_init__(self):
        _check_topk(self)

    def entries(self, layers: Layers) -> int:
        return sum(topk_entries(d, self.ratio) for d in layers.sizes)

    def payload_bytes(self, layers: Layers) -> float:
        """``k`` values and, by default, :class:`tf_sparsify.TopK`'s packed index code."""
        total = 0.0
        for d in layers.sizes:
            k = topk_entries(d, self.ratio)
            indices = index_code_bytes(d, k) if self.index_bytes is None else k * self.index_bytes
            total += k * self.value_bytes + indices
        return total

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        p, level = cluster.workers, cluster.flat_level
        return [all_gather(self.payload_bytes(layers), p, cluster.schedule, level)]


def _check_topk(method: TopKAllGather | TopKSplitReduce) -> None:
    TopK(ratio=method.ratio)  # checks ratio
    _number("value_bytes", method.value_bytes, inclusive=False)
    if method.index_bytes is not None:
        _number("index_bytes", method.index_bytes, inclusive=False)


@dataclass(frozen=True)
class TopKSplitReduce(TopKAllGather):
    """TopK entries reduced by split-and-reduce: all-to-all to slice owners, re-selection of
    ``k / P`` per owner, all-gather of those (``2 (P - 1) / P * k (v + i)`` bytes per worker)."""

    name: str = "topk-sar"

    def payload_bytes(self, layers: Layers) -> float:
        """``k`` values and indices (int32, int64 past 2^31 entries: not packed)."""
        return sum(
            topk_entries(d, self.ratio) * (self.value_bytes + _index_bytes(d, self.index_bytes))
            for d in layers.sizes
        )

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        p, level, payload = cluster.workers, cluster.flat_level, self.payload_bytes(layers)
        per_node = cluster.gpus_per_node if level == "inter" else 1
        return [
            all_to_all(payload, p, level, per_node),
            all_gather(payload / p, p, cluster.schedule, level),
        ]


@dataclass(frozen=True)
class QSGDAllGather:
    """QSGD with ``levels`` (int8 levels up to 127, else int16) and a float32 norm per bucket of
    ``bucket_size`` (None: the whole tensor); all-gather."""

    levels: int = 4
    bucket_size: int | None = None
    name: str = "qsgd"

    def __post_init__(self):
        self.compressor()  # checks levels and bucket_size

    def compressor(self) -> QSGD:
        return QSGD(self.levels, bucket_size=self.bucket_size)

    def payload_bytes(self, layers: Layers) -> float:
        """What :class:`tf_sparsify.QSGD` sends for each tensor."""
        qsgd = self.compressor()
        return sum(qsgd.wire_bytes(d) for d in layers.sizes)

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        p, level = cluster.workers, cluster.flat_level
        return [all_gather(self.payload_bytes(layers), p, cluster.schedule, level)]


@dataclass(frozen=True)
class PowerSGDAllReduce:
    """Rank ``rank`` factors of every matrix where they are smaller; two all-reduces (fp32)."""

    rank: int = 4
    name: str = "powersgd"

    def __post_init__(self):
        PowerSGD(self.rank)  # checks rank

    def factor_entries(self, layers: Layers) -> tuple[int, int]:
        """``(entries with the P factors, entries of the Q factors)``: dense tensors (vectors,
        and matrices where ``r (a + b) >= a b``) travel with ``P``."""
        powersgd = PowerSGD(self.rank)
        first = second = 0
        for shape in layers.shapes:
            dims = powersgd.matrix_shape(shape)
            if dims is None:
                first += math.prod(shape)
            else:
                first, second = first + self.rank * dims[0], second + self.rank * dims[1]
        return first, second

    def payload_bytes(self, layers: Layers) -> float:
        return 4 * sum(self.factor_entries(layers))

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        p, q = self.factor_entries(layers)
        level = cluster.flat_level
        return [all_reduce(4 * n, cluster.workers, cluster.schedule, level) for n in (p, q) if n]


@dataclass(frozen=True)
class Hierarchical:
    """Dense fp32 all-reduce inside each node (intra link), ``inner`` across the nodes."""

    inner: Method
    name: str = ""

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", f"hier-{self.inner.name}")

    def payload_bytes(self, layers: Layers) -> float:
        return self.inner.payload_bytes(layers)

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        g = cluster.gpus_per_node
        inside = [all_reduce(4 * layers.num_params, g, cluster.schedule, "intra")] if g > 1 else []
        across = replace(cluster, gpus_per_node=1, intra=None)
        return inside + (self.inner.transfers(layers, across) if cluster.nodes > 1 else [])


# -- time --------------------------------------------------------------------------------------
def link_time(transfers: Sequence[Transfer], link: Link) -> float:
    """``calls * call_overhead + rounds * alpha + max(bytes / bandwidth, sent / host_bandwidth)``
    over ``transfers`` on one link (``sent``: one worker's bytes; ``bytes``: the same, or on a
    shared medium what all workers send less the burst)."""
    calls = sum(1 for t in transfers if t.rounds)
    rounds = sum(t.rounds for t in transfers)
    sent = sum(t.bytes_sent for t in transfers)
    load = sum(t.workers * t.bytes_sent for t in transfers) if link.shared else sent
    wire = max(0.0, load - link.burst_bytes) / link.bandwidth
    fixed = calls * link.call_overhead + rounds * link.latency
    return fixed + max(wire, sent / link.host_bandwidth)


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
    _choice("overlap", overlap, OVERLAPS)
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
    compute = _number("compute", compute)
    overheads = dict(overheads or {})
    unknown = set(overheads) - {m.name for m in methods}
    if unknown:
        raise ValueError(f"`overheads` names methods not predicted: {sorted(unknown)}")
    out = []
    for method in methods:
        extra = _number(f"overheads[{method.name!r}]", overheads.get(method.name, 0.0))
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
    _number("ratio", ratio, inclusive=False)
    for name, value in (("value_bytes", value_bytes), ("index_bytes", index_bytes)):
        _number(name, value, inclusive=False)
    return (
        2
        * _number("dense_bytes", dense_bytes, inclusive=False)
        / (ratio * (value_bytes + index_bytes))
    )


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
            if _integer("workers", p) % g:
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
