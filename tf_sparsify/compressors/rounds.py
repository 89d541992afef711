"""Exchange protocols: how one unit's payloads travel, round by round.

A protocol is a generator. Each round it yields a :class:`Transfer` (which collective, which
tensors) and receives what the collective returned; at the end it returns an :class:`Outcome`
(the averaged update, the new residual, the new compressor state). The pipeline drives the
protocols of a bucket in lockstep, so one collective call per kind and round carries every
unit of the bucket. A codec needs one round (:func:`one_round`: sum or gather its payload,
decompress; :func:`entries_round` for in-place sparse updates); a multi-round exchange brings
its own: PowerSGD two all-reduces, the sparse all-reduce an all-to-all and an all-gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any

import tensorflow as tf

from tf_sparsify.compressors.error_memory import UnitMemory

#: the collective kinds a transfer can ask for
SUM, GATHER, ALL_TO_ALL = "sum", "gather", "all_to_all"
GATHER_ROWS = "gather_rows"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of a round: ``SUM`` (element-wise sum over replicas), ``GATHER`` (each
    tensor stacked over replicas), ``ALL_TO_ALL`` (rows of each tensor sent to the replicas
    by ``splits``, received concatenated in replica order) or ``GATHER_ROWS`` (each tensor's
    rows from every replica concatenated in replica order; the row counts may differ)."""

    kind: str
    tensors: tuple[tf.Tensor, ...]
    splits: tf.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """What a protocol knows of the collective: the replica count, this replica's id, and the
    divisor that turns a sum of contributions into the update."""

    count: int
    replica_id: tf.Tensor
    divisor: float


@dataclasses.dataclass
class Outcome:
    """What a unit's exchange produced."""

    #: the update (stacked over replicas with ``per_replica``)
    update: tf.Tensor
    #: the new residual (error feedback), else ``None``
    remainder: tf.Tensor | None = None
    #: the new compressor state (see ``Compressor.state_specs``)
    state: tuple[tf.Tensor, ...] = ()
    #: tensors every replica holds identically, non-finite whenever any replica's input was:
    #: the pipeline checks them to agree on a bad step
    shared: tuple[tf.Tensor, ...] = ()


Rounds = Generator[Transfer, tuple[tf.Tensor, ...], Outcome]


@dataclasses.dataclass(frozen=True)
class Started:
    """How one unit's exchange starts (``Compressor.start``): the protocol to drive, the
    context, what is sent in the first round (a codec's payload) and what the replica keeps
    already known before any transfer (a codec's remainder and momentum)."""

    rounds: Rounds
    ctx: Any
    payload: tuple[tf.Tensor, ...] = ()
    after: UnitMemory = UnitMemory()


@dataclasses.dataclass(frozen=True)
class SparseUpdate:
    """An update that is zero except at some entries: ``scale`` times the sum over rows of
    ``values`` at the flat ``indices`` (both ``[replicas, k]``, each row strictly ascending).

    ``StepFlags(sparse_updates=True)`` gives these for units of one variable whose codec
    :attr:`~tf_sparsify.compressors.base.Compressor.sends_entries`, so that a plain SGD step
    applies them in place (:func:`tf_sparsify.ops.sparse_sgd_apply`) without building the
    dense update.
    """

    values: tf.Tensor
    indices: tf.Tensor
    #: ``1 / divisor`` (the average over replicas)
    scale: float
    #: ``(start, k)``: the update is columns ``start:start + k`` of ``values`` and ``indices``,
    #: which the other units of its packed bucket share (``None``: all columns)
    columns: tuple[int, int] | None = None

    def entries(self) -> tuple[tf.Tensor, tf.Tensor]:
        """This update's own ``(values, indices)``, ``[replicas, k]``."""
        if self.columns is None:
            return self.values, self.indices
        start, k = self.columns
        return self.values[:, start : start + k], self.indices[:, start : start + k]


def one_round(codec, payload, ctx, replicas: ReplicaGroup, per_replica: bool) -> Rounds:
    """A codec's protocol: the payload is summed (summable codecs) or gathered, then
    decompressed and divided by the divisor (``per_replica``: every replica's contribution
    stacked)."""
    summed = codec.summable and not per_replica
    received = yield Transfer(SUM if summed else GATHER, payload)
    if per_replica:
        total = tf.stack(
            [codec.decompress(tuple(t[r] for t in received), ctx) for r in range(replicas.count)]
        )
    elif summed:
        update, shared = codec.decompress_scaled(received, ctx, replicas.divisor)
        return Outcome(update, shared=shared)
    else:
        total = codec.decompress_sum(received, ctx, replicas.count)
    return Outcome(scaled(total, replicas.divisor), shared=received)


def entries_round(codec, payload, ctx, replicas: ReplicaGroup) -> Rounds:
    """The protocol of a codec that sends entries: gathered, ending in a :class:`SparseUpdate`
    of the gathered entries."""
    received = yield Transfer(GATHER, payload)
    values, indices = codec.gathered_entries(received, ctx)
    return Outcome(SparseUpdate(values, indices, 1.0 / replicas.divisor), shared=received)


def scaled(tensor: tf.Tensor, divisor: float) -> tf.Tensor:
    """``tensor / divisor`` (unchanged for 1); ``1 / divisor`` is rounded once, to the tensor's
    dtype (``tf.cast`` of a Python float would round it to float32 first)."""
    return tensor if divisor == 1 else tensor * tf.constant(1.0 / divisor, tensor.dtype)
