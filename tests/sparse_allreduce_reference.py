"""NumPy reference of ``SparseAllReduce``: every replica's step written out from the algorithm
(the compressor's docstring), in the tensors' dtype, sums in the order the owners receive."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


def top(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the ``k`` entries of largest magnitude: NaN first, then by
    magnitude, ties to the lowest index."""
    magnitude = np.where(np.isnan(x), np.inf, np.abs(x))
    order = np.lexsort((np.arange(x.size), -magnitude, ~np.isnan(x)))
    return np.sort(order[:k])


@dataclasses.dataclass
class Step:
    """One step of every replica."""

    #: the update every replica applies (flat)
    update: np.ndarray
    #: each replica's new residual (flat)
    residuals: list[np.ndarray]
    #: bytes each replica hands over: all-to-all, then all-gather
    sent: list[tuple[int, int]]
    #: which owners sent their slice dense
    dense: list[bool]


def step(accs: list[np.ndarray], k: int, divisor: float) -> Step:
    """One exchange of the flat accumulators ``accs`` (``x + e``, one per replica); int32
    indices."""
    index_bytes = 4
    count, n = len(accs), accs[0].size
    dtype = accs[0].dtype
    entry = dtype.itemsize + index_bytes
    bounds = [q * n // count for q in range(count + 1)]
    picked = [top(a, k) for a in accs]
    residuals = []
    for a, idx in zip(accs, picked, strict=True):
        r = a.copy()
        r[idx] = 0
        residuals.append(r)
    update = np.zeros(n, dtype)
    sent, dense_owners = [], []
    for q in range(count):
        lo, hi = bounds[q], bounds[q + 1]
        total = np.zeros(hi - lo, dtype)
        support = set()
        for a, idx in zip(accs, picked, strict=True):  # received in replica order
            mine = idx[(idx >= lo) & (idx < hi)]
            np.add.at(total, mine - lo, a[mine])
            support.update(int(i) for i in mine - lo)
        support = np.array(sorted(support), np.int64)
        m = min(support.size, math.ceil(k / count))
        dense = (hi - lo) * dtype.itemsize + index_bytes <= m * entry
        if dense:
            update[lo:hi] = total
            gather_bytes = (hi - lo) * dtype.itemsize + index_bytes
        else:
            chosen = support[top(total[support], m)]
            update[lo + chosen] = total[chosen]
            dropped = total.copy()
            dropped[chosen] = 0
            residuals[q][lo:hi] += dropped
            gather_bytes = m * entry
        sent.append((k * entry, gather_bytes))
        dense_owners.append(dense)
    scaled = update if divisor == 1 else update * dtype.type(1.0 / divisor)
    return Step(scaled, residuals, sent, dense_owners)


def run(grads: np.ndarray, k: int, divisor: float, feedback: bool = True) -> list[Step]:
    """Steps of ``grads`` (``[steps, replicas, n]``), residuals carried with ``feedback``."""
    residuals = [np.zeros_like(g) for g in grads[0]]
    steps = []
    for per_replica in grads:
        accs = [
            g + r if feedback else g.copy() for g, r in zip(per_replica, residuals, strict=True)
        ]
        out = step(accs, k, divisor)
        residuals = out.residuals
        steps.append(out)
    return steps
