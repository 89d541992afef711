"""``P`` workers simulated on one replica, behind a transport: the state core keeps every
worker's buffers along a leading axis; each step runs the pipeline once per worker, each with
its own row of the buffers and its own :class:`~tf_sparsify.collectives.SimulatedWorkerCollective`
(its RNG keys, its contribution divided by ``P``), and stacks their contributions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import tensorflow as tf

from tf_sparsify.collectives import Collective, SimulatedWorkerCollective
from tf_sparsify.common.checks import check_int
from tf_sparsify.compressors.base import MultiRoundMethod
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.replica_values import current_values
from tf_sparsify.core.step import StepFlags, StepMemory, StepResult
from tf_sparsify.core.transport import Transport


class SimulatedWorkersTransport(Transport):
    """``count`` workers simulated on one replica (see
    :class:`~tf_sparsify.distribute.ServerOptimizer` with ``workers``)."""

    def __init__(self, count: int):
        self.simulated_workers = check_int("workers", count)

    def run_pipeline(
        self,
        pipeline: GradientPipeline,
        units: Sequence[Unit],
        grads: list,
        memory: StepMemory,
        collective: Collective,
        flags: StepFlags,
    ) -> StepResult:
        """The pipeline once per worker on gradients stacked ``[P, *shape]``, every worker's
        contribution returned (``flags.per_replica``)."""
        workers = self.simulated_workers
        if any(isinstance(u.compressor, MultiRoundMethod) for u in units):
            raise ValueError(
                f"compressor={pipeline.compressor!r} runs its own exchange, which simulated "
                "workers cannot split per worker."
            )
        for g in grads:
            if g is not None and g.shape[0] != workers:
                raise ValueError(
                    f"With workers={workers}, gradients must be stacked per worker "
                    f"([{workers}, ...]); received a gradient of shape {tuple(g.shape)}."
                )
        residuals = current_values(memory.residuals)
        momenta = current_values(memory.momenta or [])
        parts = [
            pipeline.run(
                units,
                _row(grads, p),
                StepMemory(
                    _row(residuals, p),
                    memory.iteration,
                    _row(momenta, p) if memory.momenta is not None else None,
                ),
                SimulatedWorkerCollective(p, workers),
                StepFlags(flags.measure, per_replica=True),
            )
            for p in range(workers)
        ]
        return _stack_workers(parts)


def _row(tensors: list, p: int) -> list:
    return [None if t is None else tf.convert_to_tensor(t)[p] for t in tensors]


def _stack_workers(parts: list[StepResult]) -> StepResult:
    """One StepResult for all simulated workers: contributions ``[P, ...]``, buffers stacked."""

    def join(lists, combine):
        return [
            None if column[0] is None else combine(list(column))
            for column in zip(*lists, strict=True)
        ]

    first = parts[0]
    stats = None
    if first.stats is not None:
        stats = tf.reduce_mean(tf.stack([r.stats for r in parts]), axis=0)
    return dataclasses.replace(
        first,
        updates=join([r.updates for r in parts], lambda ts: tf.concat(ts, axis=0)),
        residuals=join([r.residuals for r in parts], tf.stack),
        finite=tf.reduce_all(tf.stack([r.finite for r in parts])),
        momenta=None if first.momenta is None else join([r.momenta for r in parts], tf.stack),
        stats=stats,
    )
