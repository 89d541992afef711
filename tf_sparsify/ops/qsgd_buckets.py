"""How QSGD splits a tensor into buckets, in plain Python: no TensorFlow, no NumPy, so that the
NumPy model (:mod:`tf_sparsify.testing.numpy_reference`) and the GPU check, which runs without
TensorFlow, share it with the ops."""

from __future__ import annotations


def effective_bucket(n: int, bucket_size: int) -> int:
    """Bucket length: ``min(bucket_size, n)``, the whole tensor for 0 (at least 1)."""
    return max(n, 1) if bucket_size == 0 else max(min(bucket_size, n), 1)


def num_buckets(n: int, bucket_size: int) -> int:
    """Number of QSGD buckets (one for the whole tensor when bucket_size is 0 or >= n)."""
    return -(-n // effective_bucket(n, bucket_size))
