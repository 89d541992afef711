"""``HorovodCollective``: payloads travel through Horovod's grouped all-reduce and all-gather.

What Horovod 0.28.1 takes, and what this collective does about the rest:

- every Horovod op rejects ``bfloat16``: gathers send every tensor as its bytes (``uint8``);
  a bfloat16 all-reduce (the ``BF16`` compressor's payload) becomes that gather plus a
  local sum in float32, rounded back to bfloat16. Each rank then hands Horovod exactly the
  payload's bytes (a cast to float32 for Horovod's all-reduce would double them), at the cost
  of receiving all ``P`` payloads instead of one ring reduction.
- the all-reduce takes ``uint8, int8, int32, int64, float16, float32, float64`` only; other
  summable dtypes (int16, uint16, bool) also go by gather and a local sum.
- a grouped op needs one dtype, and every Horovod op pays its own negotiation and transfer:
  the all-gathers send their tensors' bit patterns as ``uint8`` in one grouped op (one
  transfer for a bucket's values and indices, however many dtypes); the all-reduce makes one
  grouped op per dtype, and Horovod fuses each group into one transfer.
- integer ``Average`` truncates, so only ``Sum`` is used; the pipeline divides by ``divisor``.
- XLA (``jit_compile=True``) cannot compile Horovod's ops (their XLA kernels are not built
  against TF 2.21): a collective made in an XLA context raises a ValueError that says to
  compile with ``jit_compile=False`` (:func:`reject_xla`, also called by the optimizer, the
  tape and the ``compression=`` classes before anything else).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.collectives import Collective, SimulatedWorkerCollective
from tf_sparsify.collectives.sharded import Shard, ShardedLayout
from tf_sparsify.collectives.wire import as_bytes, flat_bytes, from_bytes
from tf_sparsify.horovod._hvd import hvd
from tf_sparsify.ops.xla import in_xla_context

_REDUCIBLE = (tf.uint8, tf.int8, tf.int32, tf.int64, tf.float16, tf.float32, tf.float64)
_GATHERABLE = (*_REDUCIBLE, tf.uint16, tf.int16, tf.bool, tf.bfloat16)


def reject_xla() -> None:
    """ValueError naming ``jit_compile=False`` when traced for XLA, where Horovod's ops cannot
    run (instead of XLA's own error about unsupported operations, after tracing)."""
    if in_xla_context():
        raise ValueError(
            "Horovod's collectives do not run under XLA: compile the Keras model with "
            "`jit_compile=False` and do not use tf.function(jit_compile=True) around the "
            "exchange."
        )


class HorovodCollective(Collective):
    """One rank's view of a Horovod job (or of a process set in it): ``num_replicas`` is the
    set's size, ``divisor`` too unless given.

    Horovod users write per-rank mean losses, so the pipeline divides the sum of the ranks'
    decompressed payloads by the size.

    Args:
        after: a tensor every transfer waits for (the first-step configuration check), so no
            payload is handed to Horovod before it has passed.
        counter: an int64 variable that each transfer increases by the bytes this rank hands
            to Horovod (sizes when the transfer runs times itemsizes, after any bit-pattern
            views), so tests and users can compare it with the pipeline's ``wire_bytes``.
        process_set: the ranks the transfers run among (``None``: all); ``replica_id`` is the
            rank's index in it.
        divisor: what the sum of the contributions is divided by (``None``: ``num_replicas``;
            the hierarchical exchange sums node sums over the nodes and divides by all ranks).
        stamp: ``(fingerprint, check)``: this rank's plan fingerprint (int64) and what checks
            every rank's (``[ranks, fields] -> op``). The step's first gather carries the
            fingerprint's bytes in its one grouped op (no extra Horovod op), so ranks whose
            plans drifted apart later (``set_compressor`` on one rank) fail alike, by name.
    """

    gathers_rows = True

    def __init__(
        self,
        after: tf.Tensor | None = None,
        counter: tf.Variable | None = None,
        process_set: hvd.ProcessSet | None = None,
        divisor: float | None = None,
        stamp: tuple[tf.Tensor, Callable[[tf.Tensor], tf.Operation]] | None = None,
    ):
        reject_xla()
        self._set = hvd.global_process_set if process_set is None else process_set
        self.num_replicas = self._set.size()
        self.divisor = float(self.num_replicas if divisor is None else divisor)
        self._rank = self._set.rank()
        self._after = after
        self._counter = counter
        self._stamp = stamp

    def replica_id(self) -> tf.Tensor:
        return tf.constant(self._rank, tf.int32)

    def all_reduce_sum(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        tensors = self._gated(tensors)
        out: list[tf.Tensor | None] = [None] * len(tensors)
        native = [i for i, t in enumerate(tensors) if t.dtype in _REDUCIBLE]
        _by_dtype(tensors, native, self._reduce, out)
        other = [i for i in range(len(tensors)) if i not in native]
        if other:
            sent = _gatherable([tensors[i] for i in other])
            gathered = self._gather_bytes([flat_bytes(t) for t in sent])
            for i, g in zip(other, gathered, strict=True):
                out[i] = _local_sum(self._stacked(g, tensors[i]))
        return out

    def all_gather(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor's flat bytes, gathered in one grouped op (flat, so ranks whose payload
        sizes drifted apart still reach the plan fingerprint's check), then stacked
        ``[P, *shape]``."""
        tensors = _gatherable(self._gated(tensors))
        gathered = self._gather_bytes([flat_bytes(t) for t in tensors], stamped=True)
        return [self._stacked(g, t) for g, t in zip(gathered, tensors, strict=True)]

    def reduce_scatter_sum(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor summed over the ranks, then split along its first axis (of a length
        divisible by ``num_replicas``): replica ``i`` gets the ``i``-th part. Dtypes Horovod
        cannot reduce (bfloat16) are summed in float32 and rounded back."""
        tensors = self._gated(tensors)
        wide = [t if t.dtype in _REDUCIBLE else tf.cast(t, tf.float32) for t in tensors]
        out: list[tf.Tensor | None] = [None] * len(tensors)
        _by_dtype(
            wide,
            range(len(wide)),
            self._reduce_scatter,
            out,
            lambda i, part: tf.cast(part, tensors[i].dtype),
        )
        return out

    def all_to_all(self, tensors: list[tf.Tensor], splits: list[tf.Tensor]) -> list[tf.Tensor]:
        """``hvd.alltoall``. Horovod has no grouped all-to-all, and tensors with different
        splits cannot share one call without a further exchange of their row counts: tensors
        that share one ``splits`` tensor (a unit's values and indices) travel together as
        one tensor of byte rows, so each unit costs one call."""
        tensors = self._gated(tensors)
        groups: dict[object, list[int]] = {}
        for i, s in enumerate(splits):
            groups.setdefault(s.ref(), []).append(i)
        out: list[tf.Tensor | None] = [None] * len(tensors)
        for idx in groups.values():
            received = self._alltoall([tensors[i] for i in idx], splits[idx[0]])
            for i, r in zip(idx, received, strict=True):
                out[i] = r
        return out

    def all_gather_rows(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Tensors whose first dimension may differ by rank, as rows of bytes in one grouped
        op, each tensor's rows from every rank concatenated."""
        tensors = _gatherable(self._gated(tensors))
        gathered = self._gather_bytes([as_bytes(t) for t in tensors], stamped=True)
        return [from_bytes(g, t) for g, t in zip(gathered, tensors, strict=True)]

    # -- transfers (one dtype per call) ------------------------------------------------------
    def _reduce(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        self._count(tensors)
        return list(hvd.grouped_allreduce(tensors, op=hvd.Sum, process_set=self._set))

    def _reduce_scatter(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        self._count(tensors)
        parts = hvd.grouped_reducescatter(tensors, op=hvd.Sum, process_set=self._set)
        return [
            tf.ensure_shape(p, [t.shape[0] // self.num_replicas, *t.shape[1:]])
            for p, t in zip(parts, tensors, strict=True)
        ]

    def _gather_bytes(self, raw: list[tf.Tensor], stamped: bool = False) -> list[tf.Tensor]:
        """``uint8`` tensors, each the ranks' concatenated along its first axis: one op. With
        ``stamped``, on this step's first gather the plan fingerprint's bytes travel in the
        same op (not counted as payload) and every rank's is checked before any result is
        used."""
        self._count(raw)
        stamp = self._stamp if stamped and raw else None
        mine = [] if stamp is None else [tf.reshape(tf.bitcast(stamp[0], tf.uint8), [-1])]
        out = list(hvd.grouped_allgather([*raw, *mine], process_set=self._set))
        if stamp is None:
            return out
        self._stamp = None
        stamps = tf.bitcast(tf.reshape(out.pop(), [self.num_replicas, -1, 8]), tf.int64)
        with tf.control_dependencies([stamp[1](stamps)]):
            return [tf.identity(t) for t in out]

    def _stacked(self, gathered: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
        """The ranks' flat bytes of a tensor like ``like``, as ``[P, *shape]``."""
        return tf.reshape(from_bytes(gathered, like), [self.num_replicas, *like.shape])

    def _alltoall(self, tensors: list[tf.Tensor], splits: tf.Tensor) -> list[tf.Tensor]:
        """One ``hvd.alltoall`` of the tensors' rows side by side as bytes."""
        rows = [as_bytes(t) for t in tensors]
        packed = rows[0] if len(rows) == 1 else tf.concat(rows, axis=1)
        self._count([packed])
        received, _ = hvd.alltoall(packed, splits=tf.cast(splits, tf.int32), process_set=self._set)
        parts = tf.split(received, [r.shape[1] for r in rows], axis=1)
        return [from_bytes(p, t) for p, t in zip(parts, tensors, strict=True)]

    def _count(self, tensors: list[tf.Tensor]) -> None:
        """Add the bytes of ``tensors`` to the counter."""
        if self._counter is not None and tensors:
            sizes = [tf.size(t, out_type=tf.int64) * t.dtype.size for t in tensors]
            self._counter.assign_add(tf.add_n(sizes))

    def _gated(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        if self._after is None or not tensors:
            return list(tensors)
        with tf.control_dependencies([self._after]):
            return [tf.identity(t) for t in tensors]


class HierarchicalCollective(Collective):
    """The transfers of a hierarchical step: the pipeline's payloads travel in this rank's lane
    (across nodes) and their sum is divided by all ranks; :attr:`node` sums and gathers inside
    the node (``None`` with one rank per node), through the step's
    :class:`~tf_sparsify.collectives.sharded.ShardedLayout` (gradients to this rank's shards
    of the node's sums, shard updates to full updates).

    Args:
        topology: the registered :class:`~tf_sparsify.horovod.hierarchy.Topology`.
        shards: this rank's :class:`Shard` of each variable, ``shapes`` the variables' shapes.
        buckets: the variable indices of each bucket, in the order they travel.
        after: a tensor every transfer waits for (the configuration check).
        across, within: int64 counters of the bytes handed to Horovod across nodes (the
            payloads) and within the node (the reduce-scatter and the all-gather).
    """

    def __init__(
        self,
        topology: Any,
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
        self.layout = ShardedLayout(
            self.node, buckets, list(shards), list(shapes), topology.ranks_per_node
        )

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


def _by_dtype(
    tensors: list[tf.Tensor],
    indices,
    transfer: Callable[[list[tf.Tensor]], list[tf.Tensor]],
    out: list,
    finish: Callable[[int, tf.Tensor], tf.Tensor] = lambda i, result: result,
) -> None:
    """One ``transfer`` call per dtype of ``tensors[indices]`` (in first-seen order);
    ``out[i]`` is ``finish(i, result)`` for each tensor's result."""
    groups: dict[tf.DType, list[int]] = {}
    for i in indices:
        groups.setdefault(tensors[i].dtype, []).append(i)
    for idx in groups.values():
        for i, result in zip(idx, transfer([tensors[i] for i in idx]), strict=True):
            out[i] = finish(i, result)


def _gatherable(tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """``tensors``, or a ValueError naming a dtype the gathers do not take."""
    for t in tensors:
        if t.dtype not in _GATHERABLE:
            raise ValueError(f"Horovod cannot gather tensors of dtype {t.dtype.name}")
    return tensors


def _local_sum(gathered: tf.Tensor) -> tf.Tensor:
    """Sum over the rank axis; float16 and bfloat16 are accumulated in float32 and rounded
    once, in one pass (:func:`tf_sparsify.ops.wire_sum`)."""
    if gathered.dtype in (tf.float16, tf.bfloat16):
        return ops.wire_sum(gathered)
    return tf.reduce_sum(gathered, axis=0)
