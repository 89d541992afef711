"""PowerSGD written out in NumPy (float64) from the paper, for tests/test_powersgd.py and the
Horovod worker: the only thing taken from tf_sparsify is the seeded first ``Q`` (TF's
stateless normal draw, keyed by seed, step and tensor as the compressor documents)."""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from tf_sparsify.compressors.base import rng_seed


def seeded_q(m: int, rank: int, seed: int, step: int, tensor_id: int, dtype) -> np.ndarray:
    """The standard normal ``[m, rank]`` draw that replaces all-zero columns of ``Q``."""
    key = rng_seed(seed, step, tensor_id)
    return tf.random.stateless_normal([m, rank], seed=key, dtype=dtype).numpy().astype(np.float64)


def orthonormal(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt of full-rank columns: the Q of a QR factorization with ``diag(R) > 0``."""
    q, r = np.linalg.qr(p)
    return q * np.sign(np.diag(r))


def numpy_powersgd(
    grads: np.ndarray,
    rank: int,
    divisor: float,
    seed: int = 0,
    tensor_id: int = 0,
    draw_dtype=tf.float64,
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``grads[t, r]``: replica ``r``'s gradient at step ``t``. Per step: the update
    ``P^ (sum_r M_r^T P^)^T / divisor``, every replica's residual ``M_r - P^ P^^T M_r`` and the
    new ``Q``, the replicas' mean of ``M_r^T P^``."""
    steps, count, *shape = grads.shape
    n, m = math.prod(shape[:-1]), shape[-1]
    residuals = np.zeros((count, n, m))
    q = np.zeros((m, rank))
    out = []
    for t in range(steps):
        matrices = grads[t].reshape(count, n, m).astype(np.float64) + residuals
        fresh = seeded_q(m, rank, seed, t, tensor_id, draw_dtype)
        q = np.where(np.all(q == 0, axis=0), fresh, q)
        p_hat = orthonormal(sum(mat @ q for mat in matrices))
        mine = [mat.T @ p_hat for mat in matrices]
        total = sum(mine)
        update = p_hat @ total.T / divisor
        residuals = np.stack([mat - p_hat @ own.T for mat, own in zip(matrices, mine, strict=True)])
        q = total / count
        out.append((update.reshape(shape), residuals.reshape(count, *shape), q))
    return out
