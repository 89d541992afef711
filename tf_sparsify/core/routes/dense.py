"""The general route: any compressor, on a unit's dense gradient (joined when it has several
variables), with momentum correction, error feedback and compressor state as the options say.
The compressor's own :meth:`~tf_sparsify.compressors.base.Compressor.start` compresses and
gives the rounds (one for a codec; a multi-round method brings its own)."""

from __future__ import annotations

from tf_sparsify.compressors import error_memory
from tf_sparsify.compressors.rounds import Outcome, SparseUpdate
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.routes.route import Message, Route, StepContext, joined, split


class DenseRoute(Route):
    """Every unit the routes before it did not claim."""

    def claims(self, unit: Unit, step: StepContext) -> bool:
        return True

    def start(self, claimed: list[tuple[int, Unit]], step: StepContext) -> list[Message]:
        return [self.start_one(index, unit, step) for index, unit in claimed]

    def start_one(self, index: int, unit: Unit, step: StepContext) -> Message:
        """Momentum correction, compensation with the residual and compression of one unit
        (the rules of :mod:`tf_sparsify.compressors.error_memory`)."""
        before = self.memory(index, unit, step)
        g = joined([step.grads[i] for i in unit.indices])
        x = g
        if before.momentum is not None:
            x = error_memory.accumulate_momentum(before.momentum, g, step.momentum_factor)
        started = unit.compressor.start(
            x,
            before,
            step.memory.iteration,
            unit.indices[0],
            step.replicas,
            step.flags.per_replica,
            step.flags.sparse_updates and len(unit.shapes) == 1,
        )
        return Message(
            unit,
            self,
            started.rounds,
            before,
            started.after,
            started.payload,
            started.ctx,
            grad=g,
            x=x,
            stacked=step.flags.per_replica,
        )

    def finish(self, message: Message, outcome: Outcome) -> None:
        after = message.after
        residual = outcome.remainder if after.residual is None else after.residual
        message.after = after._replace(residual=residual, compressor_state=outcome.state)
        shapes = message.unit.shapes
        if isinstance(outcome.update, SparseUpdate):  # one variable's entries
            message.updates = [outcome.update]
        else:
            message.updates = split(outcome.update, shapes, int(message.stacked))
        none = [None] * len(shapes)
        message.residuals = none if residual is None else split(residual, shapes)
        momentum = message.after.momentum
        message.momenta = none if momentum is None else split(momentum, shapes)
