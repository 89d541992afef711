"""Exchange protocols: how one unit's payloads travel, round by round.

A protocol is a generator. Each round it yields a :class:`Transfer` (which collective, which
tensors) and receives what the collective returned; at the end it returns an :class:`Outcome`
(the averaged update, the new residual, the new compressor state). The pipeline drives the
protocols of a bucket in lockstep, so one collective call per kind and round carries every
unit of the bucket. Most compressors need one round (:func:`one_round`: compress, sum or
gather, decompress); PowerSGD needs two all-reduces, the sparse all-reduce an all-to-all and
an all-gather.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator

import tensorflow as tf

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
class Replicas:
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


Protocol = Generator[Transfer, tuple[tf.Tensor, ...], Outcome]


def scaled(tensor: tf.Tensor, divisor: float) -> tf.Tensor:
    """``tensor / divisor`` (unchanged for 1); ``1 / divisor`` is rounded once, to the tensor's
    dtype (``tf.cast`` of a Python float would round it to float32 first)."""
    return tensor if divisor == 1 else tensor * tf.constant(1.0 / divisor, tensor.dtype)
