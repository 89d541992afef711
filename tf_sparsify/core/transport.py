"""How a front end's exchange reaches the other replicas: a ``Transport``, made once per front end.

A :class:`~tf_sparsify.collectives.base.Collective` moves one step's tensors. A transport is
what a front end holds for its whole life and passes to its
:class:`~tf_sparsify.core.state.CompressionState`:

- it hands each step its collective (:meth:`Transport.collective`);
- it may keep per-process state that must never be checkpointed, because it decides whether a
  collective runs (Horovod's plan check, its byte counters);
- it may show the state core another layout of the variables (:meth:`Transport.layout`: the
  hierarchical exchange's shards), whose collective's
  :class:`~tf_sparsify.collectives.layout.Layout` then turns the step's gradients into that
  layout and the updates back;
- it runs the pipeline (:meth:`Transport.run_pipeline`: once, or once per simulated worker).

Every front end takes one: ``SparsifiedOptimizer(..., transport=...)``,
``GradientExchange(..., transport=...)``; Horovod's front ends are these with a
:class:`~tf_sparsify.horovod.HorovodTransport`. A new transport is one file: a ``Collective``
and the ``Transport`` that makes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_sparsify.collectives import Collective, current_collective
from tf_sparsify.collectives.replica_context import StrategyCollective
from tf_sparsify.core import replica_values
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.step import GradientKind, StepFlags, StepMemory, StepResult


class Transport:
    """The default: tf.distribute's replica context when one runs, else a single replica."""

    #: whether XLA can compile a step whose collectives this transport makes
    runs_under_xla: bool = True
    #: whether a step can return only the averaged dense update (no per-replica contributions,
    #: no in-place sparse updates)
    mean_only: bool = False
    #: ``P`` workers simulated on one replica, or ``None`` (the replicas are real)
    simulated_workers: int | None = None
    #: the strategy in whose scope the state was built (``None`` before)
    _strategy: tf.distribute.Strategy | None = None

    def check(self, pipeline: GradientPipeline) -> None:
        """Raise a ValueError for an option this transport cannot honour."""

    def build(self) -> None:
        """Make the per-process state (called when the exchange state is built, inside the
        strategy's scope): here, which strategy's replicas hold the rows."""
        self._strategy = tf.distribute.get_strategy()

    def layout(self, variables: Sequence) -> list:
        """What the state core plans messages and buffers for (each with ``name``, ``shape``,
        ``dtype``): the variables themselves by default."""
        return list(variables)

    def collective(
        self,
        pipeline: GradientPipeline,
        units: Sequence[Unit],
        present: Sequence[GradientKind] | None = None,
        flush: bool = False,
    ) -> Collective:
        """The collective of one step that runs ``pipeline`` on ``units``; ``present`` says
        what each variable's gradient is in this step (``None``: all dense), ``flush`` whether
        the step applies what is in flight (``apply_in_flight``)."""
        del pipeline, units, present, flush
        return current_collective()

    def job_collective(self) -> Collective | None:
        """A collective over every replica of the job, called outside a step (to measure the
        link, or to agree on measurements); ``None`` where the job is one replica."""
        strategy = self._strategy or tf.distribute.get_strategy()
        if strategy.num_replicas_in_sync > 1:
            return StrategyCollective(strategy)
        return None

    def run_pipeline(
        self,
        pipeline: GradientPipeline,
        units: Sequence[Unit],
        grads: list,
        memory: StepMemory,
        collective: Collective,
        flags: StepFlags,
    ) -> StepResult:
        """One pipeline step on the step's gradients (in the planned layout): once, on this
        replica's buffers (simulated workers run it once per worker)."""
        return pipeline.run(units, grads, memory, collective, flags)

    def checkpoint_rows(self, local: int) -> tuple[int, int]:
        """``(first, world)``: the index of this process's first row of a per-replica
        variable that has ``local`` rows here, and the number of rows in the job (what a
        checkpoint of this process holds and restores): under ``MultiWorkerMirroredStrategy``
        this worker's replicas among every worker's, else this process's replicas."""
        strategy = self._strategy
        if not replica_values.is_multi_worker(strategy):
            return 0, local
        return min(replica_values.local_replica_ids(strategy)), strategy.num_replicas_in_sync

    def gather_rows_when_saving(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray] | None:
        """Every row of the job for a checkpoint being written, where every process joins a
        write (``MultiWorkerMirroredStrategy``: the chief writes the checkpoint, the others a
        copy); ``None`` where a write is one process's alone (Horovod gathers on request:
        :func:`~tf_sparsify.horovod.gather_error_memory`)."""
        strategy = self._strategy
        if not replica_values.is_multi_worker(strategy):
            return None
        return {key: replica_values.gather_rows(strategy, value) for key, value in rows.items()}
