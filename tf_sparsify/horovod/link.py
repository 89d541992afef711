"""``HorovodLink``: what a Horovod front end keeps per process, and the collective of a step.

Both Horovod front ends (the Keras ``DistributedOptimizer`` and the custom-loop
``GradientExchange``) hold one. It owns what must never be checkpointed, because it decides
whether a collective runs or counts this process's traffic: whether this process has compared
its plan with the other ranks' (the first-step check, itself an all-gather), and the bytes it
handed to Horovod. It is a plain object, so no ``tf.train.Checkpoint`` or Keras save sees it:
after any restore every rank runs the check again, together.
"""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.horovod.check import check_once, plan_fields
from tf_sparsify.horovod.collective import reject_xla
from tf_sparsify.horovod.hierarchy import horovod_collective
from tf_sparsify.state import ExchangeState


class HorovodLink:
    """The per-process check flag and byte counters, made on first use (outside any
    ``tf.function``), and the collective each step's exchange runs through."""

    def __init__(self, ranks_per_node: int | None = None):
        self.ranks_per_node = ranks_per_node
        self.checked: tf.Variable | None = None
        self.horovod_bytes: tf.Variable | None = None
        self.within_bytes: tf.Variable | None = None

    def build(self) -> None:
        if self.checked is not None:
            return
        with tf.init_scope():
            self.checked = tf.Variable(False, trainable=False, name="plan_checked")
            self.horovod_bytes = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="horovod_bytes"
            )
            self.within_bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="within_bytes")

    def collective(self, state: ExchangeState) -> Collective:
        """The collective of one step of ``state``: the ranks' plans are compared first on
        this process's first step (and after :meth:`recheck`)."""
        reject_xla()  # first: the plan check already builds Horovod ops
        self.build()
        fields = plan_fields(state.pipeline, state.units, self.ranks_per_node)
        gate = check_once(self.checked, fields)
        return horovod_collective(state, gate, self.horovod_bytes, self.within_bytes)

    def recheck(self) -> None:
        """Compare the plans again before the next exchange (the plan changed)."""
        if self.checked is not None:
            self.checked.assign(False)

    @property
    def bytes_across_nodes(self) -> tf.Variable | None:
        """With ``ranks_per_node``: the payload bytes this process sent across nodes."""
        return None if self.ranks_per_node is None else self.horovod_bytes

    @property
    def bytes_within_nodes(self) -> tf.Variable | None:
        """With ``ranks_per_node``: the dense bytes this process handed to the reduce-scatter
        and all-gather inside its node."""
        return None if self.ranks_per_node is None else self.within_bytes
