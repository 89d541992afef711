"""Rank-0 helpers: one process prints, all of them keep running."""

from __future__ import annotations

from tf_sparsify.horovod._hvd import hvd


def is_rank0() -> bool:
    """Whether this process is Horovod's rank 0."""
    return hvd.rank() == 0


def verbose0(level: int = 1) -> int:
    """``level`` on rank 0, 0 elsewhere: ``model.fit(..., verbose=verbose0())``."""
    return level if is_rank0() else 0


def log0(*args, **kwargs) -> None:
    """``print`` on rank 0 only (flushed, so lines from horovodrun arrive in order)."""
    if is_rank0():
        print(*args, flush=True, **kwargs)
