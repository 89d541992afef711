"""tf.distribute's collectives: payloads travel through the current replica context."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.collectives.base import Collective
from tf_sparsify.collectives.local import LocalCollective
from tf_sparsify.collectives.wire import from_words, rows_from_words, to_words, words_for

_REDUCIBLE = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


class ReplicaContextCollective(Collective):
    """tf.distribute: payloads travel through the current replica context."""

    gathers_rows = True

    def __init__(self, context: tf.distribute.ReplicaContext):
        self.context = context
        self.num_replicas = context.num_replicas_in_sync

    def replica_id(self):
        return tf.cast(self.context.replica_id_in_sync_group, tf.int32)

    def all_reduce_sum(self, tensors):
        """Native all-reduce where TF's collectives take the dtype (one call per dtype: TF
        packs a call's tensors into one), else gather and add."""
        tensors = list(tensors)
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.dtype in _REDUCIBLE:
                by_dtype.setdefault(t.dtype, []).append(i)
        other = [i for i, t in enumerate(tensors) if t.dtype not in _REDUCIBLE]
        out: list[tf.Tensor | None] = [None] * len(tensors)
        for native in by_dtype.values():
            reduced = self.context.all_reduce(
                tf.distribute.ReduceOp.SUM, [tensors[i] for i in native]
            )
            for i, t in zip(native, reduced, strict=True):
                out[i] = t
        for i, t in zip(other, self.all_gather([tensors[i] for i in other]), strict=True):
            out[i] = tf.reduce_sum(t, axis=0)
        return out

    def all_gather(self, tensors):
        """One all-gather for all ``tensors``: their bytes packed into one int32 vector (TF's
        collectives run one round per tensor and lack some dtypes)."""
        if not tensors:
            return []
        words = [to_words(t) for t in tensors]
        sizes = [w.shape[0] for w in words]
        if any(size is None for size in sizes):  # no static layout: one gather per tensor
            gathered = self.context.all_gather([w[None] for w in words], axis=0)
        else:
            packed = tf.concat(words, axis=0) if len(words) > 1 else words[0]
            gathered = tf.split(self.context.all_gather(packed[None], axis=0), sizes, axis=1)
        return [from_words(g, t) for g, t in zip(gathered, tensors, strict=True)]

    def all_gather_rows(self, tensors):
        """Each tensor's rows from every replica, concatenated in replica order, with two
        all-gathers for all ``tensors``: of each replica's word count, then of every tensor's
        bytes packed into one int32 vector behind a prefix of their row counts, zero-padded to
        the longest replica's (the replica context gathers equal shapes only)."""
        if not tensors:
            return []
        counts = tf.stack([tf.shape(t, out_type=tf.int32)[0] for t in tensors])
        packed = tf.concat([counts] + [to_words(t) for t in tensors], axis=0)
        length = tf.shape(packed)[0]
        longest = tf.reduce_max(self.context.all_gather(length[None], axis=0))
        padded = tf.pad(packed, [[0, longest - length]])
        gathered = self.context.all_gather(padded[None], axis=0)
        parts: list[list[tf.Tensor]] = [[] for _ in tensors]
        for replica in range(self.num_replicas):
            row = gathered[replica]
            offset = len(tensors)
            for i, t in enumerate(tensors):
                count = row[i]
                words = words_for(count, t)
                parts[i].append(rows_from_words(row[offset : offset + words], count, t))
                offset += words
        return [tf.concat(p, axis=0) for p in parts]


def current_collective() -> Collective:
    """The collective for the calling context: tf.distribute when inside a strategy's replica."""
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError("Gradients must be exchanged in a replica context, not cross-replica.")
    if tf.distribute.has_strategy() and context.num_replicas_in_sync > 1:
        return ReplicaContextCollective(context)
    return LocalCollective()


class StrategyCollective(Collective):
    """A strategy's all-reduce called from cross-replica context (outside a step): each call
    runs on every local replica through ``strategy.run``; the result is the first replica's.
    For measurements every process must agree on (a link probe), not for gradients."""

    def __init__(self, strategy: tf.distribute.Strategy):
        self.strategy = strategy
        self.num_replicas = strategy.num_replicas_in_sync

    def all_reduce_sum(self, tensors):
        def reduce():  # each replica's own copy (a tf.function's argument is no replica's)
            context = tf.distribute.get_replica_context()
            return ReplicaContextCollective(context).all_reduce_sum(
                [tf.identity(t) for t in tensors]
            )

        results = self.strategy.run(reduce)
        return [self.strategy.experimental_local_results(r)[0] for r in results]
