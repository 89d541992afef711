"""Collectives where nothing travels: one replica, or one of several simulated on it."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.collectives.base import Collective


class LocalCollective(Collective):
    """A single replica: nothing travels."""

    gathers_rows = True

    def all_reduce_sum(self, tensors):
        return list(tensors)

    def all_gather(self, tensors):
        return [t[None] for t in tensors]

    def all_to_all(self, tensors, splits):
        return list(tensors)

    def all_gather_rows(self, tensors):
        return list(tensors)


class SimulatedWorkerCollective(LocalCollective):
    """Worker ``index`` of ``count`` simulated on one device: nothing travels, the RNG keys are
    the worker's own, and its contribution enters the update divided by ``count``."""

    def __init__(self, index: int, count: int):
        self.index = index
        self.divisor = float(count)

    def replica_id(self) -> tf.Tensor:
        return tf.constant(self.index, tf.int32)
