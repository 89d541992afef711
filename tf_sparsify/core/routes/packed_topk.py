"""The packed route: a bucket's one-variable TopK units with error feedback sent as one payload
(:mod:`tf_sparsify.compressors.topk_bucket`: one selection, one index code, one gather and one
decode for the bucket instead of one each per tensor; the same bits as sent alone)."""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_sparsify.compressors import topk_bucket
from tf_sparsify.compressors.error_memory import UnitMemory
from tf_sparsify.compressors.rounds import Outcome
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.routes.dense import DenseRoute
from tf_sparsify.core.routes.route import Message, Route, StepContext
from tf_sparsify.ops.xla import in_xla_context


@dataclasses.dataclass(frozen=True)
class PackedUnit(Unit):
    """One-variable TopK units of a bucket sent as one packed payload; their bytes are those
    of its ``parts``."""

    parts: tuple[Unit, ...] = ()

    @property
    def wire_bytes(self) -> int:
        return sum(u.wire_bytes for u in self.parts)

    @property
    def dense_bytes(self) -> int:
        return sum(u.dense_bytes for u in self.parts)


class PackedTopKRoute(Route):
    """Claims a unit whose compressor ``packs_in_buckets`` (TopK) when it is one variable with
    error feedback and no momentum correction, compressor state, diagnostics or per-replica
    contributions, outside XLA, and its values travel in the tensor's dtype on a CPU-only
    machine (:func:`~tf_sparsify.compressors.topk_bucket.packs`). A bucket's units of one
    dtype become one message; a unit alone goes the dense route."""

    def __init__(self, alone: DenseRoute):
        self._alone = alone

    def claims(self, unit: Unit, step: StepContext) -> bool:
        return (
            unit.compressor.packs_in_buckets
            and unit.error_feedback
            and len(unit.shapes) == 1
            and not step.momentum_factor
            and not unit.compressor.state_specs(unit.shape, unit.dtype)
            and not step.flags.measured
            and not step.flags.per_replica
            and not in_xla_context()
            and topk_bucket.packs(unit.compressor, unit.dtype)
        )

    def start(self, claimed: list[tuple[int, Unit]], step: StepContext) -> list[Message]:
        groups: dict[tuple[int, tf.DType], list[tuple[int, Unit]]] = {}
        for index, unit in claimed:
            groups.setdefault((unit.bucket, unit.dtype), []).append((index, unit))
        messages = []
        for group in groups.values():
            if len(group) == 1:
                messages.append(self._alone.start_one(*group[0], step))
                continue
            units = [u for _, u in group]
            grads = tuple(tf.convert_to_tensor(step.grads[u.indices[0]]) for u in units)
            residuals = [self.memory(i, u, step).residual for i, u in group]
            payload, rounds, after = topk_bucket.start(
                units, grads, residuals, step.replicas, step.flags.sparse_updates
            )
            unit = PackedUnit(
                tuple(u.indices[0] for u in units),
                tuple(u.shapes[0] for u in units),
                units[0].dtype,
                units[0].compressor,
                True,
                units[0].bucket,
                parts=tuple(units),
            )
            message = Message(unit, self, rounds, UnitMemory(), UnitMemory(), payload)
            message.residuals = list(after.residual)
            messages.append(message)
        return messages

    def finish(self, message: Message, outcome: Outcome) -> None:
        message.updates = list(outcome.update)
        message.momenta = [None] * len(message.unit.indices)
