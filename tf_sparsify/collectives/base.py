"""How payloads travel between replicas. A collective moves tensors; it knows nothing else.

Every front end (Keras on one device, tf.distribute, Horovod) is one of these behind the same
:class:`~tf_sparsify.core.pipeline.GradientPipeline`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

if TYPE_CHECKING:
    from tf_sparsify.core.pipeline import StepResult


class Collective:
    """Interface: ``all_reduce_sum`` and ``all_gather`` over lists of tensors.

    ``divisor`` turns the sum of the replicas' contributions into the update the front end
    expects: Keras under tf.distribute scales each replica's loss by ``1/num_replicas`` already
    (so its dense path sums), Horovod averages per-rank gradients (so it divides by the size).
    """

    num_replicas: int = 1
    divisor: float = 1.0
    #: whether :meth:`all_gather_rows` works (sparse gradients then travel as rows)
    gathers_rows: bool = False

    def replica_id(self) -> tf.Tensor:
        return tf.constant(0, tf.int32)

    def enter(self, grads: list) -> list:
        """The step's gradients in the layout the state core was planned on (its
        :class:`~tf_sparsify.core.transport.Transport`'s ``layout``): as they are by default."""
        return grads

    def leave(self, result: StepResult) -> StepResult:
        """The step's result in the variables' layout again (as it is by default)."""
        return result

    def all_reduce_sum(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        raise NotImplementedError

    def all_gather(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor stacked over replicas along a new leading axis of size ``num_replicas``."""
        raise NotImplementedError

    def all_to_all(self, tensors: list[tf.Tensor], splits: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor's rows sent to the replicas, ``splits[i][r]`` rows to replica ``r``;
        each result is what every replica sent here, concatenated in replica order."""
        raise _no_sparse_exchange(self, "all-to-all")

    def all_gather_rows(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        """Each tensor's rows from every replica, concatenated in replica order (the replicas'
        row counts may differ)."""
        raise _no_sparse_exchange(self, "all-gather of varying sizes")


def _no_sparse_exchange(collective: Collective, what: str) -> ValueError:
    return ValueError(
        f"{type(collective).__name__} has no {what}: the `compressor` needs one "
        "(SparseAllReduce runs under Horovod, tf_sparsify.horovod, or on a single replica; "
        "under tf.distribute use TopK)."
    )


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


class ReplicaContextCollective(Collective):
    """tf.distribute: payloads travel through the current replica context."""

    gathers_rows = True

    def __init__(self, context: tf.distribute.ReplicaContext):
        self.context = context
        self.num_replicas = context.num_replicas_in_sync

    def replica_id(self):
        return tf.cast(self.context.replica_id_in_sync_group, tf.int32)

    def all_reduce_sum(self, tensors):
        """Native all-reduce where TF's collectives take the dtype, else gather and add."""
        tensors = list(tensors)
        native = [i for i, t in enumerate(tensors) if t.dtype in _REDUCIBLE]
        other = [i for i, t in enumerate(tensors) if t.dtype not in _REDUCIBLE]
        out: list[tf.Tensor | None] = [None] * len(tensors)
        if native:
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
        words = [_to_int32(t) for t in tensors]
        sizes = [w.shape[0] for w in words]
        if any(size is None for size in sizes):  # no static layout: one gather per tensor
            gathered = self.context.all_gather([w[None] for w in words], axis=0)
        else:
            packed = tf.concat(words, axis=0) if len(words) > 1 else words[0]
            gathered = tf.split(self.context.all_gather(packed[None], axis=0), sizes, axis=1)
        return [_from_int32(g, t) for g, t in zip(gathered, tensors, strict=True)]

    def all_gather_rows(self, tensors):
        """Each tensor's rows from every replica, concatenated in replica order, with two
        all-gathers for all ``tensors``: of each replica's word count, then of every tensor's
        bytes packed into one int32 vector behind a prefix of their row counts, zero-padded to
        the longest replica's (the replica context gathers equal shapes only)."""
        if not tensors:
            return []
        counts = tf.stack([tf.shape(t, out_type=tf.int32)[0] for t in tensors])
        packed = tf.concat([counts] + [_to_int32(t) for t in tensors], axis=0)
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
                words = _words_for(count, t)
                parts[i].append(_rows_from_int32(row[offset : offset + words], count, t))
                offset += words
        return [tf.concat(p, axis=0) for p in parts]


_REDUCIBLE = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


def _words_for(rows: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """The int32 words :func:`_to_int32` makes of ``rows`` rows of a tensor like ``like``."""
    row_bytes = like.shape[1:].num_elements() * like.dtype.size
    return (rows * row_bytes + 3) // 4


def _rows_from_int32(words: tf.Tensor, rows: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`_to_int32` for ``rows`` rows of a tensor like ``like``."""
    shape = tf.concat([[rows], tf.constant(like.shape[1:].as_list(), tf.int32)], axis=0)
    size = like.dtype.size
    if size % 4 == 0:
        values = tf.reshape(words, [-1, size // 4])
        values = tf.bitcast(values, like.dtype) if size > 4 else tf.bitcast(words, like.dtype)
        return tf.reshape(values, shape)
    raw = tf.reshape(tf.bitcast(words, tf.uint8), [-1])
    elements = rows * like.shape[1:].num_elements()
    raw = tf.reshape(raw[: elements * size], [-1, size])
    values = tf.bitcast(raw, like.dtype) if size > 1 else tf.bitcast(raw[..., 0], like.dtype)
    return tf.reshape(values, shape)


def _to_int32(t: tf.Tensor) -> tf.Tensor:
    """The bytes of ``t`` (zero-padded to a multiple of 4) as a flat int32 vector."""
    if t.dtype.size % 4 == 0:
        return tf.reshape(tf.bitcast(t, tf.int32), [-1])
    raw = tf.reshape(tf.bitcast(tf.reshape(t, [-1, 1]), tf.uint8), [-1])
    pad = (-raw.shape[0]) % 4 if raw.shape[0] is not None else (-tf.size(raw)) % 4
    raw = tf.pad(raw, [[0, pad]])
    return tf.bitcast(tf.reshape(raw, [-1, 4]), tf.int32)


def _from_int32(gathered: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`_to_int32` for a ``[replicas, words]`` gather of tensors like ``like``."""
    replicas = tf.shape(gathered)[0]
    shape = tf.concat([[replicas], tf.shape(like)], axis=0)
    size = like.dtype.size
    if size % 4 == 0:
        words = tf.reshape(gathered, [replicas, -1, size // 4])
        values = (
            tf.bitcast(words, like.dtype) if size > 4 else tf.bitcast(words[..., 0], like.dtype)
        )
        return tf.reshape(values, shape)
    raw = tf.reshape(tf.bitcast(gathered, tf.uint8), [replicas, -1])
    raw = tf.reshape(raw[:, : tf.size(like) * size], [replicas, -1, size])
    values = tf.bitcast(raw, like.dtype) if size > 1 else tf.bitcast(raw[..., 0], like.dtype)
    return tf.reshape(values, shape)


def current_collective() -> Collective:
    """The collective for the calling context: tf.distribute when inside a strategy's replica."""
    context = tf.distribute.get_replica_context()
    if context is None:
        raise ValueError("Gradients must be exchanged in a replica context, not cross-replica.")
    if tf.distribute.has_strategy() and context.num_replicas_in_sync > 1:
        return ReplicaContextCollective(context)
    return LocalCollective()
