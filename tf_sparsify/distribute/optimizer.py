"""``ServerOptimizer``: a SparsifiedOptimizer whose workers' contributions pass through a server."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import keras
import tensorflow as tf
from keras.src import backend
from keras.src.utils import tracking

from tf_sparsify.collectives import Collective
from tf_sparsify.compressors.base import Compressor
from tf_sparsify.distribute.servers import Server, deserialize_server, serialize_server
from tf_sparsify.distribute.simulated import SimulatedWorker
from tf_sparsify.keras.optimizer import SparsifiedOptimizer
from tf_sparsify.pipeline import StepResult


@keras.saving.register_keras_serializable(package="tf_sparsify")
class ServerOptimizer(SparsifiedOptimizer):
    """Compressed training with a server stage (delayed updates, IAG) before the update.

    Each worker compresses its gradient as in :class:`~tf_sparsify.SparsifiedOptimizer` (error
    feedback, heuristics); every payload then travels by all-gather (a server needs each
    worker's contribution, so the all-reduce path is not used), every replica decompresses each
    worker's contribution and passes them to ``server``
    (:class:`~tf_sparsify.distribute.DelayedGradients` or :class:`~tf_sparsify.distribute.IAG`),
    and the inner optimizer applies what the server returns.

    Args:
        inner_optimizer, compressor: as for ``SparsifiedOptimizer``; its other keyword
            arguments (``error_feedback``, ``scope``, ``min_size``, ...) work the same.
        server: the server stage.
        workers: ``None``: the workers are the replicas of the current ``tf.distribute``
            strategy (one device: one worker). An integer ``P``: ``P`` workers simulated on one
            replica; ``apply`` then takes per-worker gradients stacked as ``[P, *shape]`` (see
            :class:`~tf_sparsify.distribute.SimulatedWorkers` for ``fit``), residuals are
            ``[P, *shape]`` and each worker's contribution is its gradient divided by ``P``.

    The server tables are optimizer variables (checkpointed, saved in ``.keras`` files), one
    per trainable variable; under a strategy every replica holds the same table (sync-on-read,
    each replica writes the identical value it computed; read from the first replica). The step
    counter keys the random delays and refreshes, so a restored run continues exactly. A
    variable without a gradient in a step is left alone, table included. Non-finite steps:
    nothing enters the tables (see each server) and the update handed on is non-finite, as in
    :mod:`tf_sparsify.pipeline`.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        compressor: Compressor,
        server: Server,
        workers: int | None = None,
        **kwargs: Any,
    ):
        if not isinstance(server, Server):
            raise ValueError(
                "`server` must be a tf_sparsify.distribute server (DelayedGradients, IAG); "
                f"received server={server!r}"
            )
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise ValueError(f"`workers` must be None or an integer >= 1; received {workers=!r}")
        super().__init__(inner_optimizer, compressor, **kwargs)
        if workers is not None and self.pipeline.local_clipnorm is not None:
            raise ValueError(
                "`local_clipnorm` is not supported with simulated `workers`; "
                f"received local_clipnorm={self.pipeline.local_clipnorm!r}, workers={workers!r}"
            )
        self.server = server
        self.workers = workers
        self.num_workers = workers
        self._tables = []

    # -- state --------------------------------------------------------------------------------
    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if self.workers is not None and replicas > 1:
            raise ValueError(
                f"`workers` simulates workers on one replica; under a strategy with {replicas} "
                f"replicas use workers=None (received workers={self.workers!r})."
            )
        self.num_workers = self.workers or replicas
        self.server.check_workers(self.num_workers)
        super().build(var_list)
        self._tables = [self._add_table(v) for v in var_list]

    def _add_residual(self, variable, suffix: str = "residual"):
        """Per-worker buffers: ``[P, *shape]`` when workers are simulated."""
        if self.workers is not None:
            variable = types.SimpleNamespace(
                shape=(self.workers, *variable.shape), dtype=variable.dtype, name=variable.name
            )
        return super()._add_residual(variable, suffix)

    def _add_table(self, variable) -> backend.Variable:
        """The server table; every replica writes the identical value it computed."""
        return self.add_replica_variable(
            (*self.server.table_dims(self.num_workers), *variable.shape),
            variable.dtype,
            f"{variable.name}_table",
            "only_first_replica",
        )

    @property
    def tables(self) -> list:
        """The server table of each trainable variable."""
        return list(self._tables)

    # -- one step -----------------------------------------------------------------------------
    def exchange(self, grads: list, collective: Collective, measure=None) -> StepResult:
        """Every worker's contribution through the pipeline, then through the server."""
        return self._serve(self._contributions(grads, collective, measure))

    def _contributions(self, grads: list, collective: Collective, measure) -> StepResult:
        residuals = _values(self._residuals)
        momenta = None
        if self.pipeline.momentum_correction > 0:
            momenta = _values(self._momenta)
        step = self._iterations
        if self.workers is None:
            if collective.num_replicas != self.num_workers:
                raise ValueError(
                    f"ServerOptimizer was built for {self.num_workers} workers but runs on "
                    f"{collective.num_replicas} replicas."
                )
            return self.pipeline.step(
                self._units, grads, residuals, step, collective, momenta, measure, per_replica=True
            )
        for g, v in zip(grads, self._trainable_variables, strict=True):
            if g is not None and tuple(g.shape) != (self.workers, *v.shape):
                raise ValueError(
                    f"With workers={self.workers}, gradients must be stacked per worker: expected "
                    f"shape {(self.workers, *v.shape)} for {v.name}, received {tuple(g.shape)}."
                )
        parts = [
            self.pipeline.step(
                self._units,
                _row(grads, p),
                _row(residuals, p),
                step,
                SimulatedWorker(p, self.workers),
                None if momenta is None else _row(momenta, p),
                measure,
                per_replica=True,
            )
            for p in range(self.workers)
        ]
        return _stack_workers(parts)

    def _serve(self, result: StepResult) -> StepResult:
        step = self._iterations
        schedule = self.server.schedule(step, self.num_workers)
        poison = tf.where(result.finite, 0.0, float("nan"))
        updates = []
        for table, contributions in zip(self._tables, result.updates, strict=True):
            if contributions is None:
                updates.append(None)
                continue
            update, new_table = self.server.combine(
                table.value, contributions, step, schedule, result.finite
            )
            table.assign(new_table)
            updates.append(update + tf.cast(poison, update.dtype))
        return dataclasses.replace(result, updates=updates)

    # -- serialization ------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["server"] = serialize_server(self.server)
        config["workers"] = self.workers
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> ServerOptimizer:
        config = dict(config)
        config["server"] = deserialize_server(config["server"])
        return super().from_config(config, custom_objects)


def _values(variables: list) -> list:
    return [None if v is None else v.value for v in variables]


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
    momenta = None
    if first.momenta is not None:
        momenta = join([r.momenta for r in parts], tf.stack)
    stats = None
    if first.stats is not None:
        stats = tf.reduce_mean(tf.stack([r.stats for r in parts]), axis=0)
    return StepResult(
        updates=join([r.updates for r in parts], lambda ts: tf.concat(ts, axis=0)),
        residuals=join([r.residuals for r in parts], tf.stack),
        finite=tf.reduce_all(tf.stack([r.finite for r in parts])),
        momenta=momenta,
        stats=stats,
        sent_bytes=first.sent_bytes,
    )
