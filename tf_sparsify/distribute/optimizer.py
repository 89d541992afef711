"""``ServerOptimizer``: a SparsifiedOptimizer whose workers' contributions pass through a server."""

from __future__ import annotations

import dataclasses
from typing import Any

import keras
import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.compressors.base import Compressor
from tf_sparsify.compressors.error_memory import mark_non_finite
from tf_sparsify.core.step import StepResult
from tf_sparsify.distribute.servers import Server, deserialize_server, serialize_server
from tf_sparsify.distribute.simulated_workers import SimulatedWorkersTransport
from tf_sparsify.keras import keras_private
from tf_sparsify.keras.optimizer import SparsifiedOptimizer


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
        inner_optimizer: as for ``SparsifiedOptimizer``.
        compressor: as for ``SparsifiedOptimizer``.
        server: the server stage.
        workers: ``None``: the workers are the replicas of the current ``tf.distribute``
            strategy (one device: one worker). An integer ``P``: ``P`` workers simulated on one
            replica; ``apply`` then takes per-worker gradients stacked as ``[P, *shape]`` (see
            :class:`~tf_sparsify.distribute.SimulatedWorkers` for ``fit``), residuals are
            ``[P, *shape]`` and each worker's contribution is its gradient divided by ``P``.
        **kwargs: ``SparsifiedOptimizer``'s other keyword arguments (``error_feedback``,
            ``scope``, ``min_size``, ...), which work the same.

    The server tables are optimizer variables (checkpointed, saved in ``.keras`` files), one
    per trainable variable; under a strategy every replica holds the same table (sync-on-read,
    each replica writes the identical value it computed; read from the first replica). The step
    counter keys the random delays and refreshes, so a restored run continues exactly. A
    variable without a gradient in a step is left alone, table included. Non-finite steps:
    nothing enters the tables (see each server) and the update handed on is non-finite, as in
    :mod:`tf_sparsify.core.pipeline`.
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
        if kwargs.get("late_buckets", "none") != "none":
            raise ValueError(
                "ServerOptimizer simulates delays through its `server`; real late buckets do "
                "not go with it: use server=DelayedGradients(1) or a SparsifiedOptimizer with "
                f"late_buckets; received late_buckets={kwargs['late_buckets']!r}"
            )
        transport = None if workers is None else SimulatedWorkersTransport(workers)
        super().__init__(inner_optimizer, compressor, transport=transport, **kwargs)
        if workers is not None and self.pipeline.options.local_clipnorm is not None:
            raise ValueError(
                "`local_clipnorm` is not supported with simulated `workers`; "
                f"received local_clipnorm={self.pipeline.options.local_clipnorm!r}, "
                f"workers={workers!r}"
            )
        self.server = server
        self.simulated_workers = workers
        self.worker_count = workers
        self._tables = []

    # -- state --------------------------------------------------------------------------------
    @keras_private.no_automatic_dependency_tracking
    def build(self, var_list):
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if self.simulated_workers is not None and replicas > 1:
            raise ValueError(
                f"`workers` simulates workers on one replica; under a strategy with {replicas} "
                f"replicas use workers=None (received workers={self.simulated_workers!r})."
            )
        self.worker_count = self.simulated_workers or replicas
        self.server.check_workers(self.worker_count)
        super().build(var_list)
        self._tables = [
            keras_private.replica_variable(
                self,
                (*self.server.table_dims(self.worker_count), *v.shape),
                v.dtype,
                f"{v.name}_table",
                "only_first_replica",  # every replica writes the identical value it computed
            )
            for v in var_list
        ]

    @property
    def tables(self) -> list:
        """The server table of each trainable variable."""
        return list(self._tables)

    # -- one step -----------------------------------------------------------------------------
    def compression_step(self, grads: list, collective: Collective) -> StepResult:
        """Every worker's contribution through the compression state, then through the
        server."""
        if self.simulated_workers is None and collective.num_replicas != self.worker_count:
            raise ValueError(
                f"ServerOptimizer was built for {self.worker_count} workers but runs on "
                f"{collective.num_replicas} replicas."
            )
        step = tf.identity(self._state.step)  # the step before the state advances it
        return self._serve(self._state.run(grads, collective, per_replica=True), step)

    def _serve(self, result: StepResult, step: tf.Tensor) -> StepResult:
        schedule = self.server.schedule(step, self.worker_count)
        updates = []
        for table, contributions in zip(self._tables, result.updates, strict=True):
            if contributions is None:
                updates.append(None)
                continue
            update, new_table = self.server.combine(
                table.value, contributions, step, schedule, result.finite
            )
            table.assign(new_table)
            updates.append(mark_non_finite(update, result.finite))
        return dataclasses.replace(result, updates=updates)

    # -- serialization ------------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["server"] = serialize_server(self.server)
        config["workers"] = self.simulated_workers
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects=None) -> ServerOptimizer:
        config = dict(config)
        config["server"] = deserialize_server(config["server"])
        return super().from_config(config, custom_objects)
