"""Every rank's error memory in one checkpoint, and back to every rank.

Each rank keeps its own residuals and momenta. Horovod's idiom writes checkpoints on rank 0
only, which would hold rank 0's error memory alone. So, on every rank, before rank 0 saves::

    tf_sparsify.horovod.gather_error_memory(optimizer)   # or a GradientExchange
    if hvd.rank() == 0:
        checkpoint.write(path)

and the checkpoint holds every rank's rows. Restore it on every rank (each takes its own row),
or on rank 0 alone followed by :class:`~tf_sparsify.horovod.BroadcastGlobalVariablesCallback`
(or :func:`scatter_error_memory` in a custom loop), which hands each rank its row.
"""

from __future__ import annotations

from tf_sparsify.horovod._hvd import hvd
from tf_sparsify.keras.wrapped import find_sparsified


def _holder(holder):
    """The front end that holds the exchange state (a Keras optimizer chain is searched)."""
    found = find_sparsified(holder)
    if found is not None:
        return found
    if hasattr(holder, "exchange_checkpoint"):
        return holder
    raise ValueError(
        "Expected a tf_sparsify optimizer (or a chain holding one) or a GradientExchange; "
        f"received {holder!r}"
    )


def gather_error_memory(holder) -> None:
    """Gather every rank's per-replica state into ``holder``'s next checkpoint (a collective:
    call it on every rank; it holds for saves at the current step)."""
    holder = _holder(holder)
    checkpoint = holder.exchange_checkpoint
    checkpoint.gathered(holder.transport.gather_rows(checkpoint.local_rows()))


def scatter_error_memory(holder, root_rank: int = 0) -> None:
    """After ``root_rank`` alone restored a checkpoint holding every rank's rows, give every
    rank its own (a collective: call it on every rank). Does nothing when the root restored
    no such checkpoint."""
    holder = _holder(holder)
    checkpoint = holder.exchange_checkpoint
    rows = hvd.broadcast_object(
        checkpoint.restored_rows if hvd.rank() == root_rank else None,
        root_rank=root_rank,
        name="tf_sparsify_scatter_error_memory",
    )
    if rows:
        checkpoint.restore_rows(rows)
    checkpoint.restored_rows = {}
