"""Shared fixtures. Four logical CPU devices exist for every test process.

Two MirroredStrategy objects in one process can collide on collective instance keys, so the
session has exactly one 2-replica strategy (``mirrored2``); tests needing another replica
count run in a subprocess (see ``run_python``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 4)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The ops' float dtypes, their names in the NumPy reference, and unsigned ints of their width.
KIND = {
    tf.float16: "float16",
    tf.bfloat16: "bfloat16",
    tf.float32: "float32",
    tf.float64: "float64",
}
UINT = {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}
DTYPES = list(KIND)


@pytest.fixture
def compiled():
    """The raw op module; fails under TF_SPARSIFY_REQUIRE_OPS=1 when it is missing."""
    import tf_sparsify.ops as ops

    if not ops.is_compiled():
        reason = ops.info().reason
        if os.environ.get(ops.REQUIRE_ENV) == "1":
            pytest.fail(f"compiled ops required but unavailable: {reason}")
        pytest.skip(f"compiled ops unavailable: {reason}")
    return ops._library().module


@pytest.fixture(scope="session")
def mirrored2() -> tf.distribute.MirroredStrategy:
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def run_python(code: str, timeout: int = 300, env: dict | None = None) -> str:
    """Run ``code`` in a fresh interpreter (repo on the path); return stdout, fail on error."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout
