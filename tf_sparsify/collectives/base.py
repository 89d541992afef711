"""The interface of a collective: how one step's tensors travel between replicas. A collective
moves tensors; it knows nothing else.

Every front end (Keras on one device, tf.distribute, Horovod) is one of these behind the same
pipeline; its :attr:`Collective.layout` says how the step's gradients map onto what the state
core planned (as they are, or the hierarchical exchange's shards).
"""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.collectives.layout import IDENTITY, Layout


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
    #: how the step's gradients map onto the planned layout, and its updates back
    layout: Layout = IDENTITY

    def replica_id(self) -> tf.Tensor:
        return tf.constant(0, tf.int32)

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
