"""What one timed window's per-step seconds, gathered from every process, say.

``step_times[r, s]`` is process ``r``'s seconds for step ``s`` of the window, each step timed
from the end of the one before (its result read back), so a row sums to that process's window.
"""

from __future__ import annotations

import numpy as np


def _checked(step_times: np.ndarray) -> np.ndarray:
    times = np.asarray(step_times, dtype=np.float64)
    if times.ndim != 2 or 0 in times.shape:
        raise ValueError(
            f"step_times must be a non-empty [ranks, steps] matrix, got shape {times.shape}"
        )
    if not np.all(np.isfinite(times)) or np.any(times < 0):
        raise ValueError(f"step_times must be finite and >= 0, got {times.tolist()}")
    return times


def slowest_pace(step_times: np.ndarray) -> float:
    """Seconds per step of the slowest process over the whole window (max over ranks of the
    mean step): the best pace processes that only meet at the window's end could keep."""
    return float(_checked(step_times).mean(axis=1).max())


def lockstep_floor(step_times: np.ndarray) -> float:
    """Mean over steps of the slowest process's step (mean over steps of max over ranks): what
    the same steps cost when every step waits for the slowest process, with nothing moved.
    Never below :func:`slowest_pace`; above it by as much as the processes' per-step jitter
    does not line up."""
    return float(_checked(step_times).max(axis=0).mean())
