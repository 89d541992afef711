"""What the Horovod worker scripts share: start-up, a result line per check, exit status."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    import horovod.tensorflow as hvd
except ImportError as error:
    sys.exit(f"HOROVOD MISSING: `import horovod.tensorflow` failed: {error}")

hvd.init()

PREFIX = "RESULT "
# The worker whose checks run now: the script's name, or the one suite.py runs.
WORKER = os.path.splitext(os.path.basename(sys.argv[0]))[0]


class Checks:
    """Runs named checks on every rank; each prints one ``RESULT {json}`` line."""

    def __init__(self):
        self.failed: list[str] = []

    def run(self, name: str, check: Callable[[], dict | None]) -> None:
        start = time.perf_counter()
        try:
            detail = check() or {}
            ok = True
        except Exception as error:  # reported, then the next check runs
            detail = {"error": f"{type(error).__name__}: {error}"[:2000]}
            detail["traceback"] = traceback.format_exc()[-3000:]
            ok = False
        if not ok:
            self.failed.append(name)
        seconds = round(time.perf_counter() - start, 2)
        line = {
            "rank": hvd.rank(),
            "worker": WORKER,
            "check": name,
            "ok": ok,
            "seconds": seconds,
            **detail,
        }
        print(PREFIX + json.dumps(line, default=float), flush=True)

    def exit(self) -> None:
        sys.exit(1 if self.failed else 0)


def assert_close(actual, expected, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> float:
    """Raise AssertionError naming ``what`` unless close; return the max abs difference."""
    import numpy as np

    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {actual.shape} != {expected.shape}")
    diff = float(np.max(np.abs(actual - expected))) if actual.size else 0.0
    if not np.allclose(actual, expected, rtol=rtol, atol=atol):
        raise AssertionError(f"{what}: max abs difference {diff}")
    return diff


def train_step(opt, variables: list) -> Callable:
    """``opt.apply`` on ``variables`` in a tf.function, like model.fit's train step (the
    optimizer built first, as fit builds it: a step that makes variables is traced twice)."""
    import tensorflow as tf

    opt.build(variables)

    @tf.function
    def apply(grads):
        opt.apply(grads, variables)

    return apply
