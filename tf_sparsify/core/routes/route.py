"""The interface of a route: one way a unit's gradient is compressed and sent.

The pipeline offers each unit (with a gradient this step) to its routes in order; the first
that :meth:`~Route.claims` it starts it. A route decides by what the unit's compressor declares
it can do (its capabilities: ``travels_as_rows``, ``packs_in_buckets``) and by the step
(:class:`StepContext`), never by the compressor's type. It reads the unit's memory, starts its
rounds, turns the outcome into per-variable updates and residuals, and counts its wire bytes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.compressors.error_memory import UnitMemory
from tf_sparsify.compressors.rounds import Outcome, ReplicaGroup, Rounds
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.step import StepFlags, StepMemory, Update


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What every route sees of the step."""

    #: the step's gradients, aligned with the planned variables (clipped when clipping is on)
    grads: Sequence[Any]
    memory: StepMemory
    replicas: ReplicaGroup
    flags: StepFlags
    #: the DGC momentum factor (0: no momentum correction)
    momentum_factor: float
    #: whether the step's collective can gather rows of varying counts
    gathers_rows: bool
    #: whether local clipping is on (it needs every gradient dense)
    clipped: bool


@dataclasses.dataclass
class Message:
    """One unit's trip through a step: started by its route, completed by the exchange."""

    #: the unit as sent: only its variables that have a gradient
    unit: Unit
    route: Route
    #: the rounds of transfers the exchange drives
    rounds: Rounds
    #: the unit's memory before the step, and what it keeps after (complete once exchanged)
    before: UnitMemory
    after: UnitMemory
    #: what the first round sends, and what a receiver knows besides it
    payload: tuple[tf.Tensor, ...] = ()
    ctx: Any = None
    #: the fresh gradient and what was compressed (``grad``, or momentum-corrected), joined;
    #: kept by the routes that measurements read
    grad: tf.Tensor | None = None
    x: tf.Tensor | None = None
    #: the update carries every replica's contribution along a leading axis (``per_replica``)
    stacked: bool = False
    #: per variable of ``unit`` after the exchange
    updates: list[Update] = dataclasses.field(default_factory=list)
    residuals: list[Any] = dataclasses.field(default_factory=list)
    momenta: list[tf.Tensor | None] = dataclasses.field(default_factory=list)


class Route(abc.ABC):
    """One compress path."""

    @abc.abstractmethod
    def claims(self, unit: Unit, step: StepContext) -> bool:
        """Whether this route serves ``unit`` (restricted to its variables with a gradient)."""

    @abc.abstractmethod
    def start(self, claimed: list[tuple[int, Unit]], step: StepContext) -> list[Message]:
        """The messages of the units this route claimed (with each one's planned index), their
        compression done and their rounds ready to drive."""

    @abc.abstractmethod
    def finish(self, message: Message, outcome: Outcome) -> None:
        """Complete ``message`` from its exchange's outcome: its per-variable updates,
        residuals and momenta, and what the unit keeps."""

    def sent_bytes(self, message: Message) -> int | tf.Tensor:
        """The bytes ``message`` put on the wire (static unless a route's payload depends on
        the data)."""
        return message.unit.wire_bytes

    @staticmethod
    def memory(index: int, unit: Unit, step: StepContext) -> UnitMemory:
        """The unit's memory before the step: its residual and momentum values, joined, and
        its compressor state."""
        memory = step.memory
        return UnitMemory(
            joined([memory.residuals[i] for i in unit.indices]) if unit.error_feedback else None,
            joined([memory.momenta[i] for i in unit.indices]) if step.momentum_factor else None,
            () if memory.states is None else tuple(memory.states[index]),
        )


def joined(tensors: list) -> tf.Tensor:
    """One tensor as it is, several flattened and concatenated."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if len(tensors) == 1:
        return tensors[0]
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def split(tensor: tf.Tensor, shapes: tuple[tf.TensorShape, ...], leading: int = 0) -> list:
    """Inverse of :func:`joined`, on the axes after the first ``leading`` ones."""
    if len(shapes) == 1:
        return [tensor]
    parts = tf.split(tensor, [s.num_elements() for s in shapes], axis=leading)
    lead = tensor.shape[:leading]
    return [tf.reshape(p, lead.concatenate(s)) for p, s in zip(parts, shapes, strict=True)]
