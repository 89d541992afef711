"""Buckets: which units travel together, the plan's rule (``core/plan.py``) that the step model
prices (one collective per setting and bucket)."""

from __future__ import annotations

from collections.abc import Sequence

#: Default bucket size in bytes of dense gradient (as PyTorch DDP's bucket_cap_mb).
DEFAULT_BUCKET_BYTES = 25 * 2**20


def fill_buckets(dense_bytes: Sequence[int], bucket_bytes: int) -> list[int]:
    """The bucket of each unit, given in backprop order (the last variables' first) with its
    bytes of dense gradient: as in PyTorch DDP, a bucket closes once it holds ``bucket_bytes``
    or more (bucket 0 travels first)."""
    buckets, bucket, filled = [], 0, 0
    for size in dense_bytes:
        buckets.append(bucket)
        filled += size
        if filled >= bucket_bytes:
            bucket, filled = bucket + 1, 0
    return buckets
