"""NumPy model of sparse gradients exchanged over their touched rows
(``tf_sparsify.core.routes.sparse_rows``),
shared by ``tests/test_sparse_gradients.py`` and the Horovod worker ``sparse_rows.py``.

The gradients' values are multiples of 1/8 in float64, so every sum is exact whatever its
order and the models are compared exactly."""

from __future__ import annotations

import fractions
import math

import numpy as np

SHAPE = (12, 3)
STEPS = 4


def sparse_grads(seed: int, replicas: int, steps: int = STEPS) -> list[list[tuple]]:
    """``[step][replica] -> (indices, values)``: a few rows each (duplicates included, a
    different count per replica and step), values multiples of 1/8."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(replicas):
            count = int(rng.integers(2, 7))
            indices = rng.integers(0, SHAPE[0], size=count).astype(np.int64)
            indices[-1] = indices[0]  # a duplicate
            values = rng.integers(-40, 41, size=(count, *SHAPE[1:])) / 8.0
            step.append((indices, values))
        out.append(step)
    return out


def cast_grads(seed: int, replicas: int, steps: int = STEPS) -> list[list[tuple]]:
    """As :func:`sparse_grads`, the values float32 multiples of 2**-12 below 4: FP16 and BF16
    round them, and every sum of them and their rounding errors here is exact."""
    rng = np.random.default_rng(seed)
    return [
        [
            (i, (rng.integers(-(2**14), 2**14, size=v.shape) / 2.0**12).astype(np.float32))
            for i, v in step
        ]
        for step in sparse_grads(seed, replicas, steps)
    ]


def densified(indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    dense = np.zeros(SHAPE)
    np.add.at(dense, indices, values)
    return dense


def topk_model(grads, ratio: float, divisor: float) -> tuple[list[np.ndarray], np.ndarray]:
    """TopK over the touched rows with error feedback: each step's averaged update (dense)
    and the final residuals ``[replicas, *SHAPE]`` (untouched rows' residual unchanged)."""

    def top(acc: np.ndarray) -> np.ndarray:
        flat = acc.reshape(-1)
        k = max(1, math.ceil(fractions.Fraction(repr(ratio)) * flat.size))
        chosen = np.argsort(-np.abs(flat), kind="stable")[:k]  # ties: lowest index
        sent = np.zeros_like(flat)
        sent[chosen] = flat[chosen]
        return sent.reshape(acc.shape)

    return feedback_model(grads, top, divisor)


def cast_model(grads, wire: np.dtype, divisor: float) -> tuple[list[np.ndarray], np.ndarray]:
    """FP16 or BF16 (``wire``: ``np.float16`` or ``ml_dtypes.bfloat16``) over the touched rows
    with error feedback, as :func:`topk_model` (round to nearest even; no value here is
    beyond the wire type's range or below its normal range)."""
    return feedback_model(grads, lambda acc: acc.astype(wire).astype(np.float64), divisor)


def feedback_model(grads, send, divisor: float) -> tuple[list[np.ndarray], np.ndarray]:
    """Error feedback over the touched rows: each replica sends ``send(acc)`` of its touched
    rows' ``acc = gradient + residual`` and keeps ``acc - sent`` as their residual; each step's
    update (dense) is the sum of what was sent over the divisor; the final residuals
    ``[replicas, *SHAPE]``."""
    replicas = len(grads[0])
    residual = np.zeros((replicas, *SHAPE))
    updates = []
    for step in grads:
        total = np.zeros(SHAPE)
        for r, (indices, values) in enumerate(step):
            rows = np.unique(indices)
            acc = densified(indices, values)[rows] + residual[r][rows]
            sent = send(acc)
            residual[r][rows] = acc - sent
            total[rows] += sent
        updates.append(total / divisor)
    return updates, residual


def entries_sent(grads, ratio: float, replica: int) -> int:
    """How many entries ``replica`` sends over the steps (k of its touched entries)."""
    width = int(np.prod(SHAPE[1:]))
    share = fractions.Fraction(repr(ratio))
    return sum(
        max(1, math.ceil(share * np.unique(step[replica][0]).size * width)) for step in grads
    )
