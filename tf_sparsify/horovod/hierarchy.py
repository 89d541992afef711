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

import tensorflow as tf

from tf_sparsify.collectives.base import Collective, SimulatedWorkerCollective
from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.error_memory import mark_non_finite
from tf_sparsify.core.pipeline import GradientPipeline, StepResult, Unit
from tf_sparsify.horovod._hvd import hvd
from tf_sparsify.horovod.collective import HorovodCollective


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


# -- the state core on shards ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shard:
    """What the state core sees of a variable: this rank's part of its node's sum, ``1/L`` of
    the entries rounded up, flat but with the variable's rank (so ``skip_1d`` still tells
    biases from kernels)."""

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: tf.DType


def shard_of(variable, ranks_per_node: int) -> Shard:
    shape = tf.TensorShape(variable.shape)
    size = -(-shape.num_elements() // ranks_per_node)
    trailing = (1,) * max(shape.rank - 1, 0)
    path = getattr(variable, "path", None) or variable.name
    return Shard(variable.name, path, (size, *trailing), tf.as_dtype(variable.dtype))


class HierarchicalCollective(Collective):
    """The transfers of a hierarchical step: the pipeline's payloads travel in this rank's lane
    (across nodes) and their sum is divided by all ranks; :attr:`node` sums and gathers inside
    the node (``None`` with one rank per node). :meth:`enter` turns the step's gradients into
    this rank's shards of the node's sums, :meth:`leave` the shard updates into full updates.

    Args:
        topology: the registered :class:`Topology`.
        shards: this rank's :class:`Shard` of each variable, ``shapes`` the variables' shapes.
        buckets: the variable indices of each bucket, in the order they travel.
        after: a tensor every transfer waits for (the configuration check).
        across, within: int64 counters of the bytes handed to Horovod across nodes (the
            payloads) and within the node (the reduce-scatter and the all-gather).
    """

    def __init__(
        self,
        topology: Topology,
        shards: Sequence[Shard],
        shapes: Sequence[tf.TensorShape],
        buckets: list[list[int]],
        after: tf.Tensor | None = None,
        across: tf.Variable | None = None,
        within: tf.Variable | None = None,
    ):
        self.lane: Collective = (
            SimulatedWorkerCollective(0, topology.size)  # one node: the payloads go nowhere
            if topology.lane_set is None
            else HorovodCollective(after, across, topology.lane_set, divisor=topology.size)
        )
        self.node = (
            None
            if topology.node_set is None
            else HorovodCollective(after, within, topology.node_set)
        )
        self.num_replicas = self.lane.num_replicas
        self.divisor = self.lane.divisor
        self._ranks_per_node = topology.ranks_per_node
        self._shards = list(shards)
        self._shapes = list(shapes)
        self._buckets = buckets

    def enter(self, grads: list) -> list:
        return _scatter(self.node, grads, self._buckets, self._shards, self._ranks_per_node)

    def leave(self, result: StepResult) -> StepResult:
        return _gather(self.node, result, self._buckets, self._shapes)

    def replica_id(self) -> tf.Tensor:
        return self.lane.replica_id()

    def all_reduce_sum(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        return self.lane.all_reduce_sum(tensors)

    def all_gather(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        return self.lane.all_gather(tensors)

    def all_to_all(self, tensors: list[tf.Tensor], splits: list[tf.Tensor]) -> list[tf.Tensor]:
        return self.lane.all_to_all(tensors, splits)

    def all_gather_rows(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        return self.lane.all_gather_rows(tensors)


def check_pipeline(pipeline: GradientPipeline) -> None:
    """ValueError for options the hierarchical exchange cannot honour: ``local_clipnorm`` (it
    clips each rank's own gradients, which this exchange sums inside the node before anything
    is compressed) and shape-aware compressors (PowerSGD factors matrices; the shards are
    flat)."""
    if pipeline.local_clipnorm is not None:
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


def _scatter(
    node: HorovodCollective | None,
    grads: list,
    buckets: list[list[int]],
    shards: list[Shard],
    ranks_per_node: int,
) -> list[tf.Tensor | None]:
    """This rank's shard of its node's sum of each gradient (one reduce-scatter per bucket);
    ``None`` gradients stay ``None``."""
    out: list[tf.Tensor | None] = [None] * len(grads)
    for bucket in buckets:
        present = [i for i in bucket if grads[i] is not None]
        flat = [_padded(grads[i], ranks_per_node * shards[i].shape[0]) for i in present]
        parts = flat if node is None else node.reduce_scatter_sum(flat)
        for i, part in zip(present, parts, strict=True):
            out[i] = tf.reshape(part, shards[i].shape)
    return out


def _padded(grad, length: int) -> tf.Tensor:
    flat = tf.reshape(tf.convert_to_tensor(grad), [-1])
    return tf.pad(flat, [[0, length - flat.shape[0]]])


def _gather(
    node: HorovodCollective | None,
    result: StepResult,
    buckets: list[list[int]],
    shapes: list[tf.TensorShape],
) -> StepResult:
    """The full updates from the node's shard updates (one all-gather per bucket), each shard
    NaN unless its lane's step was finite; ``finite`` is then the same on every rank."""
    updates: list[tf.Tensor | None] = [None] * len(shapes)
    checks = []
    for bucket in buckets:
        present = [i for i in bucket if result.updates[i] is not None]
        parts = [
            mark_non_finite(tf.reshape(result.updates[i], [-1]), result.finite) for i in present
        ]
        gathered = parts if node is None else node.all_gather(parts)
        for i, whole in zip(present, gathered, strict=True):
            checks.append(tf.reduce_all(tf.math.is_finite(whole)))
            entries = tf.reshape(whole, [-1])[: shapes[i].num_elements()]
            updates[i] = tf.reshape(entries, shapes[i])
    finite = tf.reduce_all(tf.stack(checks)) if checks else result.finite
    return dataclasses.replace(result, updates=updates, finite=finite)
