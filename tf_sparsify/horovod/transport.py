"""``HorovodTransport``: how both Horovod front ends reach the other ranks.

The Keras ``DistributedOptimizer`` and the custom-loop ``GradientExchange`` each hold one. It
owns what must never be checkpointed, because it decides whether a collective runs or counts
this process's traffic: whether this process has compared its plan with the other ranks' (the
first-step check, itself an all-gather), and the bytes it handed to Horovod. It is a plain
object, so no ``tf.train.Checkpoint`` or Keras save sees it: after any restore every rank runs
the check again, together.

With ``ranks_per_node`` it is the hierarchical exchange (:mod:`tf_sparsify.horovod.hierarchy`):
the state core sees this rank's shards of the variables, and each step's
:class:`~tf_sparsify.horovod.hierarchy.HierarchicalCollective` sums inside the node, carries the
compressed shards across nodes and gathers the full updates.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_sparsify.collectives import Collective
from tf_sparsify.collectives.sharded import Shard, shard_of
from tf_sparsify.common.checks import check_int
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.step import GradientKind
from tf_sparsify.core.transport import Transport
from tf_sparsify.horovod import hierarchy
from tf_sparsify.horovod._hvd import hvd
from tf_sparsify.horovod.check import (
    FIELDS,
    assert_same,
    check_once,
    check_step,
    plan_fields,
    stamp,
)
from tf_sparsify.horovod.collective import (
    HierarchicalCollective,
    HorovodCollective,
    reject_xla,
)


class HorovodTransport(Transport):
    """Horovod's collectives, after the ranks' plan check (the first step's; with late buckets
    every step's); the check's flag and fingerprint and the byte counters are made on first
    use (outside any ``tf.function``).

    Args:
        ranks_per_node: ``None``: the flat exchange among all ranks. An integer: the
            hierarchical exchange with nodes of that many ranks (needs
            ``tf_sparsify.horovod.init(ranks_per_node=...)`` at start-up); its steps return the
            averaged dense update only.
    """

    runs_under_xla = False

    def __init__(self, ranks_per_node: int | None = None):
        self.ranks_per_node = (
            None if ranks_per_node is None else check_int("ranks_per_node", ranks_per_node)
        )
        self.mean_only = ranks_per_node is not None
        self.checked: tf.Variable | None = None
        self.plan_sent: tf.Variable | None = None
        self.horovod_bytes: tf.Variable | None = None
        self.within_bytes: tf.Variable | None = None
        self._topology: hierarchy.Topology | None = None
        self._shards: list[Shard] = []
        self._shapes: list[tf.TensorShape] = []

    def check(self, pipeline: GradientPipeline) -> None:
        if self.ranks_per_node is not None:
            hierarchy.check_pipeline(pipeline)

    def build(self) -> None:
        if self.checked is not None:
            return
        with tf.init_scope():
            self.checked = tf.Variable(False, trainable=False, name="plan_checked")
            self.plan_sent = tf.Variable(
                tf.zeros([len(FIELDS)], tf.int64), trainable=False, name="plan_sent"
            )
            self.horovod_bytes = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="horovod_bytes"
            )
            self.within_bytes = tf.Variable(0, dtype=tf.int64, trainable=False, name="within_bytes")

    def layout(self, variables: Sequence) -> list:
        """The variables, or with ``ranks_per_node`` this rank's shard of each."""
        if self.ranks_per_node is None:
            return list(variables)
        self._topology = hierarchy.topology(self.ranks_per_node)
        self._shapes = [tf.TensorShape(v.shape) for v in variables]
        self._shards = [shard_of(v, self.ranks_per_node) for v in variables]
        return list(self._shards)

    def collective(
        self,
        pipeline: GradientPipeline,
        units: Sequence[Unit],
        present: Sequence[GradientKind] | None = None,
        flush: bool = False,
    ) -> Collective:
        """The collective of one step: the ranks' plans (and which variables have gradients)
        are compared on this process's first step before anything travels, and again with
        every step's first gather (the flat exchange), so ranks whose plans drift apart later
        (``set_compressor`` on one rank) fail by name. With late buckets every step is checked
        before anything travels (the late payloads travel while the step computes, so the
        check's round trip hides too): a rank applying what is in flight (``flush``) while
        another trains fails by name instead of waiting forever."""
        reject_xla()  # first: the plan check already builds Horovod ops
        self.build()
        fields = plan_fields(pipeline, units, self.ranks_per_node, present, flush)
        every_step = pipeline.options.late_buckets != "none"
        if every_step:
            gate = check_step(self.plan_sent, fields)
        else:
            gate = check_once(self.checked, self.plan_sent, fields)
        if self.ranks_per_node is None:
            local = stamp(fields)
            return HorovodCollective(
                gate,
                self.horovod_bytes,
                stamp=None if every_step else (local, lambda s: assert_same(s, local, fields)),
            )
        return HierarchicalCollective(
            self._topology,
            self._shards,
            self._shapes,
            hierarchy.buckets(units),
            gate,
            self.horovod_bytes,
            self.within_bytes,
        )

    def job_collective(self) -> Collective | None:
        """All ranks' flat all-reduce (outside a step), or ``None`` with one rank."""
        return HorovodCollective() if hvd.size() > 1 else None

    def checkpoint_rows(self, local: int) -> tuple[int, int]:
        """One row per rank: this rank's, of ``hvd.size()`` (outside a Horovod job, the one
        process's)."""
        if not hvd.is_initialized():
            return 0, local
        return hvd.rank() * local, hvd.size() * local

    def gather_rows(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every rank's rows of each per-replica variable (a collective: every rank calls
        it, with the same keys)."""
        by_rank = hvd.allgather_object(rows, name="tf_sparsify_error_memory")
        return {k: np.concatenate([r[k] for r in by_rank]) for k in sorted(rows)}

    @property
    def bytes_across_nodes(self) -> tf.Variable | None:
        """With ``ranks_per_node``: the payload bytes this process sent across nodes."""
        return None if self.ranks_per_node is None else self.horovod_bytes

    @property
    def bytes_within_nodes(self) -> tf.Variable | None:
        """With ``ranks_per_node``: the dense bytes this process handed to the reduce-scatter
        and all-gather inside its node."""
        return None if self.ranks_per_node is None else self.within_bytes
