"""How each variable of the state core is held across replicas: :class:`StateKind`."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf


class StateKind(str, enum.Enum):  # noqa: UP042 (enum.StrEnum is Python 3.11+; we run on 3.10)
    """A state variable's kind: who writes it and how a read across replicas combines it.

    The values are the names checkpoint manifests record.
    """

    #: each replica writes its own copy, summed when read across replicas (residuals, momenta)
    PER_REPLICA = "per_replica"
    #: the same, averaged (diagnostics)
    PER_REPLICA_MEAN = "per_replica_mean"
    #: each replica writes its own, identical copy (a custom exchange's state, agreed through
    #: its collectives; read as the first replica's)
    REPLICATED = "replicated"
    #: one value (counters, the front end's own variables; the first replica's)
    SHARED = "shared"

    @property
    def aggregation(self) -> tf.VariableAggregation:
        """How a read across replicas combines the copies."""
        return {
            StateKind.PER_REPLICA: tf.VariableAggregation.SUM,
            StateKind.PER_REPLICA_MEAN: tf.VariableAggregation.MEAN,
        }.get(self, tf.VariableAggregation.ONLY_FIRST_REPLICA)

    @property
    def synchronization(self) -> tf.VariableSynchronization:
        """``ON_READ`` where each replica writes its own copy, else ``AUTO``."""
        if self is StateKind.SHARED:
            return tf.VariableSynchronization.AUTO
        return tf.VariableSynchronization.ON_READ

    @property
    def per_replica(self) -> bool:
        """Whether every replica holds its own value (checkpoints keep one row per replica)."""
        return self in (StateKind.PER_REPLICA, StateKind.PER_REPLICA_MEAN)

    def resized(self, rows: np.ndarray, count: int) -> np.ndarray:
        """``count`` rows that hold what ``rows`` (one per replica of another job) hold: each
        variable's total is conserved (summed, then split evenly), not each row's value; a
        mean keeps its mean. The one conservation rule of every restore."""
        total = rows.sum(0) if self is StateKind.PER_REPLICA else rows.mean(0)
        share = total / count if self is StateKind.PER_REPLICA else total
        return np.stack([share] * count).astype(rows.dtype)

    @classmethod
    def of_aggregation(cls, aggregation: tf.VariableAggregation) -> StateKind:
        """The per-replica kind of a sync-on-read variable with this aggregation."""
        summed = aggregation == tf.VariableAggregation.SUM
        return cls.PER_REPLICA if summed else cls.PER_REPLICA_MEAN


#: ``make_variable(name, shape, dtype, kind)``: a zero variable, tracked by the front end.
VariableFactory = Callable[[str, tuple[int, ...], tf.DType, StateKind], Any]
