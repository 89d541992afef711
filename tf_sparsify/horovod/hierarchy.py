"""Hierarchical exchange: dense sums inside each node, compressed payloads only across nodes.

With ``ranks_per_node=L`` a job of ``P = N * L`` ranks is ``N`` nodes of ``L`` ranks. Each
step, bucket by bucket, the rank with index ``j`` in its node:

1. sums its node's gradients densely and keeps one ``1/L`` part of the sum: a Horovod
   reduce-scatter among the node's ranks of each gradient, flattened and zero-padded to a
   multiple of ``L`` (rank ``j`` keeps shard ``j``);
2. runs the state core on its shards: compensation with the shard's residual (error feedback
   happens where compression happens), compression with the user's compressor, and the
   exchange of the payloads with rank ``j`` of every other node (its *lane*). Every rank of a
   node carries a different shard across nodes, as in BytePS and CGX, so no rank is a
   bottleneck and only compressed payloads cross nodes;
3. all-gathers the shard updates inside its node: every rank gets the whole update, the sum
   over the nodes divided by ``P`` (Horovod's mean over ranks).

Non-finite steps: a lane agrees on its own step from the payloads it received (as the flat
exchange does); each rank then marks its shard update NaN unless its lane's step was finite,
so the node's all-gather shows every rank a bad step of any lane, and every rank keeps its
residuals alike.

The node and lane groups are Horovod process sets, which Horovod 0.28.1 adds after
``hvd.init`` only with dynamic process sets: call :func:`init` on every rank at start-up
instead of ``hvd.init()`` (or set ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` before ``hvd.init()`` and
call :func:`init` after it).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from typing import Any

from tf_sparsify.common.checks import check_int
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import Unit
from tf_sparsify.horovod._hvd import hvd


@dataclasses.dataclass(frozen=True)
class Topology:
    """The job's nodes (each a sorted tuple of global ranks) and this rank's place in them."""

    nodes: tuple[tuple[int, ...], ...]
    #: this rank's node, and its index inside it (which shard it carries)
    node: int
    local: int
    #: the process set of this rank's node (``None`` with one rank per node: nothing to sum)
    node_set: Any
    #: the process set of the ranks with this rank's index on every node (``None`` with one
    #: node: nothing crosses nodes)
    lane_set: Any

    @property
    def ranks_per_node(self) -> int:
        return len(self.nodes[0])

    @property
    def size(self) -> int:
        return len(self.nodes) * self.ranks_per_node


#: the topologies :func:`init` registered, by ranks per node
_TOPOLOGIES: dict[int, Topology] = {}
#: the process sets added to Horovod, by their ranks
_SETS: dict[tuple[int, ...], Any] = {}


def init(ranks_per_node: int | None = None) -> Topology:
    """Initialize Horovod (with dynamic process sets) unless done, and register the process
    sets of the hierarchical exchange with ``ranks_per_node`` ranks per node.

    ``None``: the real nodes (ranks grouped by host name; every node must hold as many ranks).
    An integer: nodes of that many consecutive ranks (``horovodrun`` places ranks host by host;
    a smaller number simulates nodes, e.g. 4 ranks on one machine as 2 nodes of 2). Every rank
    must call it alike: it runs collectives, and ranks that ask for different values all get a
    ValueError naming ``ranks_per_node``. Calling it again for the same value is cheap.
    """
    if not hvd.is_initialized():
        hvd.init(process_sets="dynamic")
    size = hvd.size()
    if ranks_per_node is not None:
        check_ranks_per_node(ranks_per_node, size)
    asked = hvd.allgather_object((ranks_per_node, socket.gethostname()), name="tf_sparsify_init")
    requests = [request for request, _ in asked]
    if len(set(requests)) > 1:
        raise ValueError(
            "Every rank must call tf_sparsify.horovod.init with the same `ranks_per_node`; "
            f"by rank, they asked for ranks_per_node={requests}."
        )
    if ranks_per_node is None:
        nodes = _host_nodes([host for _, host in asked])
    else:
        nodes = tuple(tuple(range(s, s + ranks_per_node)) for s in range(0, size, ranks_per_node))
    per_node = len(nodes[0])
    if per_node not in _TOPOLOGIES:
        _TOPOLOGIES[per_node] = _register(nodes, hvd.rank())
    return _TOPOLOGIES[per_node]


def check_ranks_per_node(ranks_per_node: Any, size: int) -> int:
    """``ranks_per_node`` as an int; ValueError naming it unless it is >= 1 and divides
    ``size`` (the number of ranks)."""
    check_int("ranks_per_node", ranks_per_node)
    if size % ranks_per_node:
        raise ValueError(
            f"`ranks_per_node` must divide the number of ranks ({size}); "
            f"received ranks_per_node={ranks_per_node!r}"
        )
    return int(ranks_per_node)


def topology(ranks_per_node: int) -> Topology:
    """The topology :func:`init` registered for ``ranks_per_node``; ValueError if none."""
    check_ranks_per_node(ranks_per_node, hvd.size())
    if ranks_per_node not in _TOPOLOGIES:
        raise ValueError(
            f"ranks_per_node={ranks_per_node} needs its Horovod process sets: call "
            f"tf_sparsify.horovod.init(ranks_per_node={ranks_per_node}) on every rank at "
            "start-up (instead of hvd.init())."
        )
    return _TOPOLOGIES[ranks_per_node]


def _host_nodes(hosts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each host, hosts in order of their first rank."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    nodes = tuple(tuple(ranks) for ranks in by_host.values())
    if len({len(ranks) for ranks in nodes}) > 1:
        counts = {host: len(ranks) for host, ranks in by_host.items()}
        raise ValueError(
            f"The hierarchical exchange needs as many ranks on every node; ranks per host: "
            f"{counts}. Give ranks_per_node to group consecutive ranks instead."
        )
    return nodes


def _register(nodes: tuple[tuple[int, ...], ...], rank: int) -> Topology:
    """Add every node's and every lane's process set (all ranks, in the same order) and
    return this rank's topology."""
    lanes = tuple(zip(*nodes, strict=True))
    node_sets = [_process_set(ranks) for ranks in nodes]
    lane_sets = [_process_set(ranks) for ranks in lanes]
    node = next(c for c, ranks in enumerate(nodes) if rank in ranks)
    local = nodes[node].index(rank)
    return Topology(nodes, node, local, node_sets[node], lane_sets[local])


def _process_set(ranks: tuple[int, ...]):
    """Horovod's process set of ``ranks``: ``None`` for one rank, the global one for all."""
    if len(ranks) == 1:
        return None
    if len(ranks) == hvd.size():
        return hvd.global_process_set
    if ranks not in _SETS:
        try:
            _SETS[ranks] = hvd.add_process_set(list(ranks))
        except ValueError as error:
            raise ValueError(
                f"{error} Call tf_sparsify.horovod.init() instead of hvd.init() at start-up: "
                "it turns Horovod's dynamic process sets on."
            ) from error
    return _SETS[ranks]


# -- the plan on shards ------------------------------------------------------------------------
def check_pipeline(pipeline: GradientPipeline) -> None:
    """ValueError for options the hierarchical exchange cannot honour: ``local_clipnorm`` (it
    clips each rank's own gradients, which this exchange sums inside the node before anything
    is compressed) and shape-aware compressors (PowerSGD factors matrices; the shards are
    flat)."""
    if pipeline.options.local_clipnorm is not None:
        raise ValueError(
            "`local_clipnorm` clips each rank's own gradients, but with ranks_per_node the "
            "ranks of a node sum theirs before compression: use ranks_per_node=None, or "
            "clip in the inner optimizer (global_clipnorm)."
        )
    if pipeline.compressor.shape_aware:
        raise ValueError(
            f"{pipeline.compressor!r} compresses each tensor by its shape, but with "
            "ranks_per_node every rank compresses a flat shard of it: use ranks_per_node=None."
        )


def buckets(units: Sequence[Unit]) -> list[list[int]]:
    """The variable indices of each bucket, buckets in the order they travel."""
    by_bucket: dict[int, list[int]] = {}
    for unit in sorted(units, key=lambda u: u.bucket):
        by_bucket.setdefault(unit.bucket, []).extend(unit.indices)
    return list(by_bucket.values())
