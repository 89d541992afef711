"""The what-if's network: links, clusters, collectives, and the alpha-beta time of a link.

A collective costs ``c + rounds * alpha + bytes_sent * beta`` (Hockney's model plus a per-call
cost ``c``): ``rounds`` message rounds on the critical path, ``alpha`` seconds per round,
``bytes_sent`` what one worker puts on its link, ``beta = 1 / bandwidth``. Links are full duplex
and every collective here is symmetric (a worker receives what it sends), so the bytes sent set
the time. With ``P`` workers, ``m`` payload bytes per worker and ``R(P) = P - 1``
(``schedule="ring"``: Gloo, Horovod, NCCL's ring) or ``ceil(log2 P)`` (``"logarithmic"``:
recursive halving/doubling, Bruck; the same bytes in fewer rounds):

- all-reduce (reduce-scatter, then all-gather of ``m / P`` slices):
  ``2 R(P) alpha + 2 (P - 1) / P * m * beta``, flat in ``P``.
- all-gather (every worker receives every payload): ``R(P) alpha + (P - 1) m beta``, linear
  in ``P``.
- all-to-all (pairwise, ``P - 1`` rounds under either schedule; a worker sends ``m / P`` to each
  other owner): ``(P - 1) alpha + (P - 1) / P * m * beta``.

Flat methods on ``nodes x gpus_per_node`` run over all ``P`` workers on the inter-node link (on
the intra-node link when there is one node): a ring placed node by node crosses each node's link
with one flow per round; an all-to-all sends ``g (P - g) / P * m`` bytes from a node's ``g``
ranks to other nodes. ``Link.shared`` models one medium for all workers (a loopback under
``tc``): the bytes of all ``P`` workers queue behind one rate limit, less a token bucket's
``burst_bytes`` that refills while the step computes. ``Link.host_bandwidth`` caps what one
worker can push (memory copies, kernel TCP); link and host work as a pipeline, so the slower of
the two sets the time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tf_sparsify.common.checks import check_int, check_number

Schedule = Literal["ring", "logarithmic"]
SCHEDULES = ("ring", "logarithmic")


def check_choice(name: str, value: str, allowed: Sequence[str]) -> str:
    """``value`` if it is one of ``allowed``, else a ValueError naming ``name``."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {tuple(allowed)}; got {value!r}")
    return value


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
                check_number(name, getattr(self, name), low=0, low_open=True)
        check_number("latency", self.latency, low=0)
        check_number("burst_bytes", self.burst_bytes, low=0)
        if self.burst_bytes and not self.shared:
            raise ValueError(
                "`burst_bytes` (a token bucket's depth) applies only to a shared medium "
                f"(`shared=True`); got burst_bytes={self.burst_bytes!r} with shared=False"
            )
        check_number("call_overhead", self.call_overhead, low=0)


@dataclass(frozen=True)
class Cluster:
    """``nodes x gpus_per_node`` workers; ``inter`` joins nodes, ``intra`` the GPUs of a node."""

    nodes: int
    inter: Link
    gpus_per_node: int = 1
    intra: Link | None = None
    schedule: Schedule = "ring"

    def __post_init__(self):
        check_int("nodes", self.nodes)
        check_int("gpus_per_node", self.gpus_per_node)
        check_choice("schedule", self.schedule, SCHEDULES)
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
