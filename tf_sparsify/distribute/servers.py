"""Server stages: what happens to the workers' contributions between the exchange and the update.

A server receives, per variable, every worker's decompressed contribution of this step as one
tensor ``[P, *shape]`` (already divided so that their sum is the synchronous update: Keras scales
each replica's loss by ``1/P``, simulated workers divide by ``P``) and returns the update the
inner optimizer applies. What it must remember lives in a table, an optimizer variable of shape
``table_dims(P) + shape`` that every replica holds identically.

- :class:`DelayedGradients`: each worker's contribution is applied ``tau`` steps after it was
  computed (bounded staleness, as with an asynchronous parameter server).
- :class:`IAG`: incremental aggregated gradient; the table holds each worker's last contribution,
  some workers refresh theirs each step, the update is the sum of the table.

Random choices (random delays, random refresh) come from stateless RNG keyed by ``(seed, step)``:
runs repeat, and every replica draws the same.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_sparsify.common.checks import check_int, check_seed
from tf_sparsify.common.registry import Registry
from tf_sparsify.compressors.base import rng_seed

DELAY_MODELS = ("fixed", "random", "per_replica")
#: the ``tensor_id`` of the servers' RNG stream: no tensor has it, so a server never draws the
#: numbers a compressor with the same seed draws.
SERVER_STREAM = -1
REFRESH_RULES = ("cyclic", "random")


class Server:
    """Interface: a table layout, a per-step schedule and the combine rule."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Server:
        return cls(**config)

    def table_dims(self, num_workers: int) -> tuple[int, ...]:
        """Leading dimensions of the table kept for each variable."""
        raise NotImplementedError

    def check_workers(self, num_workers: int) -> None:
        """ValueError if this server cannot serve ``num_workers`` workers."""

    def schedule(self, step: tf.Tensor, num_workers: int) -> tf.Tensor:
        """What this step does per worker (delays, or who refreshes), shared by all variables."""
        raise NotImplementedError

    def combine(
        self,
        table: tf.Tensor,
        contributions: tf.Tensor,
        step: tf.Tensor,
        schedule: tf.Tensor,
        finite: tf.Tensor,
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """``(update, new_table)``; a non-finite step (``finite`` False) never enters the table."""
        raise NotImplementedError

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError


class DelayedGradients(Server):
    """Apply each worker's contribution ``tau`` steps after it was computed.

    Args:
        delay: ``tau``, an integer >= 0; with ``model="per_replica"`` a list with one delay per
            worker.
        model: ``"fixed"`` (every worker, every step: ``tau``), ``"random"`` (worker ``p`` at
            step ``t`` uses the contribution of step ``t - d``, ``d`` uniform in ``[0, tau]``,
            drawn per step and worker) or ``"per_replica"`` (worker ``p`` always lags
            ``delay[p]`` steps: stragglers).
        seed: the RNG seed of the random model.

    At step ``t`` the update is ``sum_p c_p(t - d_p(t))``; a contribution from before the first
    step (``t - d < 0``) is zero: nothing has arrived yet. ``tau = 0`` is synchronous training.
    The table is a ring buffer of the last ``tau + 1`` steps' contributions, ``[tau + 1, P]``
    leading dimensions (memory: ``(tau + 1) * P`` copies of the model on every replica). A
    non-finite step contributes zeros.
    """

    def __init__(self, delay: int | Sequence[int], model: str = "fixed", seed: int = 0):
        if model not in DELAY_MODELS:
            raise ValueError(f"`model` must be one of {DELAY_MODELS}; received model={model!r}")
        if model == "per_replica":
            if isinstance(delay, str | bytes) or not isinstance(delay, Sequence) or not delay:
                raise ValueError(
                    "`delay` must be a non-empty list of integers >= 0 (one per worker) with "
                    f"model='per_replica'; received delay={delay!r}"
                )
            self.delay: int | tuple[int, ...] = tuple(
                check_int("delay", d, minimum=0) for d in delay
            )
        else:
            self.delay = check_int("delay", delay, minimum=0)
        self.model = model
        self.seed = check_seed(seed)

    @property
    def max_delay(self) -> int:
        """The staleness bound ``tau``."""
        return max(self.delay) if self.model == "per_replica" else self.delay

    def table_dims(self, num_workers: int) -> tuple[int, ...]:
        return (self.max_delay + 1, num_workers)

    def check_workers(self, num_workers: int) -> None:
        if self.model == "per_replica" and len(self.delay) != num_workers:
            raise ValueError(
                f"`delay` must have one entry per worker ({num_workers}); received "
                f"delay={list(self.delay)!r}"
            )

    def delays(self, step: tf.Tensor | int, num_workers: int) -> tf.Tensor:
        """``[P]`` int32: how many steps old each worker's applied contribution is at ``step``."""
        if self.model == "fixed":
            return tf.fill([num_workers], tf.constant(self.delay, tf.int32))
        if self.model == "per_replica":
            return tf.constant(self.delay, tf.int32)
        return tf.random.stateless_uniform(
            [num_workers],
            seed=rng_seed(self.seed, step, SERVER_STREAM),
            minval=0,
            maxval=self.delay + 1,
            dtype=tf.int32,
        )

    def schedule(self, step, num_workers):
        return self.delays(step, num_workers)

    def combine(self, table, contributions, step, schedule, finite):
        slots = self.max_delay + 1
        t = tf.cast(step, tf.int64)
        incoming = tf.where(finite, contributions, tf.zeros_like(contributions))
        table = tf.tensor_scatter_nd_update(table, [[t % slots]], incoming[None])
        num_workers = contributions.shape[0]
        read = tf.stack(
            [(t - tf.cast(schedule, tf.int64)) % slots, tf.range(num_workers, dtype=tf.int64)],
            axis=1,
        )
        return tf.reduce_sum(tf.gather_nd(table, read), axis=0), table

    def get_config(self) -> dict[str, Any]:
        delay = list(self.delay) if self.model == "per_replica" else self.delay
        return {"delay": delay, "model": self.model, "seed": self.seed}


class IAG(Server):
    """Incremental aggregated gradient: the server keeps the last contribution of every worker.

    Args:
        refresh: ``"cyclic"`` (at step ``t`` workers ``(t * m + j) mod P``, ``j < m``, refresh
            their entry) or ``"random"`` (``m`` workers drawn uniformly without replacement per
            step, keyed by ``(seed, step)``).
        num_refresh: ``m``, the workers refreshed per step (``1 <= m <= P``).
        seed: the RNG seed of the random rule.

    At step 0 every worker fills its entry (the table starts at the gradients of the initial
    point). The update is the sum of the table: with contributions already divided by ``P``,
    the average of the workers' last gradients. Cyclic refresh with ``m = 1`` has staleness
    ``P - 1``. A simulation: every worker still computes and sends each step; the traffic of
    the method itself is ``m`` payloads per step. A non-finite step refreshes nothing.
    """

    def __init__(self, refresh: str = "cyclic", num_refresh: int = 1, seed: int = 0):
        if refresh not in REFRESH_RULES:
            raise ValueError(
                f"`refresh` must be one of {REFRESH_RULES}; received refresh={refresh!r}"
            )
        num_refresh = check_int("num_refresh", num_refresh)
        self.refresh = refresh
        self.num_refresh = num_refresh
        self.seed = check_seed(seed)

    def staleness(self, num_workers: int) -> int | None:
        """The largest age of a table entry with cyclic refresh; ``None`` (unbounded) if random."""
        if self.refresh == "random":
            return None
        return math.ceil(num_workers / self.num_refresh) - 1

    def table_dims(self, num_workers: int) -> tuple[int, ...]:
        return (num_workers,)

    def check_workers(self, num_workers: int) -> None:
        if self.num_refresh > num_workers:
            raise ValueError(
                f"`num_refresh` must be at most the number of workers ({num_workers}); "
                f"received num_refresh={self.num_refresh!r}"
            )

    def refreshed(self, step: tf.Tensor | int, num_workers: int) -> tf.Tensor:
        """``[P]`` bool: which workers refresh their entry at ``step``."""
        t = tf.cast(step, tf.int64)
        if self.refresh == "cyclic":
            first = (t * self.num_refresh) % num_workers
            offset = (tf.range(num_workers, dtype=tf.int64) - first) % num_workers
            chosen = offset < self.num_refresh
        else:
            keys = tf.random.stateless_uniform(
                [num_workers], seed=rng_seed(self.seed, step, SERVER_STREAM)
            )
            rank = tf.argsort(tf.argsort(keys))
            chosen = rank < self.num_refresh
        return tf.logical_or(chosen, tf.equal(t, 0))

    def schedule(self, step, num_workers):
        return self.refreshed(step, num_workers)

    def combine(self, table, contributions, step, schedule, finite):
        mask = tf.logical_and(schedule, finite)
        mask = tf.reshape(mask, [-1] + [1] * (contributions.shape.rank - 1))
        table = tf.where(mask, contributions, table)
        return tf.reduce_sum(table, axis=0), table

    def get_config(self) -> dict[str, Any]:
        return {"refresh": self.refresh, "num_refresh": self.num_refresh, "seed": self.seed}


_SERVERS = Registry("server", Server)
_SERVERS.add(DelayedGradients)
_SERVERS.add(IAG)


def serialize_server(server: Server) -> dict[str, Any]:
    return _SERVERS.serialize(server)


def deserialize_server(config: dict[str, Any] | Server) -> Server:
    """Inverse of :func:`serialize_server`; a server instance passes through."""
    return _SERVERS.deserialize(config)
