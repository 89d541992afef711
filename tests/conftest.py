"""Shared fixtures. Four logical CPU devices exist for every test process.

Two MirroredStrategy objects in one process can collide on collective instance keys, so the
session has exactly one 2-replica strategy (``mirrored2``); tests needing another replica
count run in a subprocess (see ``run_python``).
"""

from __future__ import annotations

import ast
import gc
import inspect
import os
import re
import tempfile
import textwrap
from typing import TYPE_CHECKING

import pytest

from tests.script_runner import run_forked

if TYPE_CHECKING:
    import tensorflow as tf


def pytest_configure(config):
    """TensorFlow as every test process has it: four logical CPU devices, and XLA's CPU
    backend compiling the tests' steps at LLVM -O0 with its elemental emitters rather than the
    newer MLIR fusion emitters, their min and max propagating NaN as the fusion emitters' do
    (the same HLO and, with fast math off, XLA's default, the same IEEE results, for a third
    less CPU in tests/test_xla.py; XLA reads the flags at its first compile). Then what the
    imports made, which lives as long as the process, is frozen: the collector stops scanning
    it (about half of its time in a pytest worker). Not in pytest-xdist's controller, which
    runs no test: it would import TensorFlow (about 4 s) before it starts the workers."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    os.environ.setdefault(
        "XLA_FLAGS",
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
        "--xla_cpu_enable_fast_min_max=false",
    )
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 4)
    gc.freeze()


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
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def run_python(code: str, timeout: int = 300, env: dict | None = None) -> str:
    """Run ``code`` in a new process, a fork of a warm interpreter with TensorFlow imported
    and not started (:func:`tests.script_runner.run_forked`), in the repository's folder;
    return its stdout, fail on error."""
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "code.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(textwrap.dedent(code))
        proc = run_forked(script, env=env, timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


# -- test selection and order ------------------------------------------------------------------
#: what in a function's own code launches a process or needs Horovod (built by `make horovod`)
LAUNCHES = re.compile(
    r"\b(?:run_python|run_forked|run_local_workers|horovodrun|subprocess\.(?:run|Popen|check_call"
    r"|check_output))\(|\bimport horovod\b|\bfrom horovod\b|\btf_sparsify\.horovod\b"
)
_launchers: dict[str, set[str]] = {}


def _launching_functions(module) -> set[str]:
    """The names of ``module``'s top-level functions whose code launches a process (or needs
    Horovod), or calls one of its helpers that does."""
    if module.__name__ not in _launchers:
        source = inspect.getsource(module)
        functions = {
            node.name: ast.get_source_segment(source, node)
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef)
        }
        helpers = {n for n, code in functions.items() if not n.startswith("test")}
        launching = {n for n, code in functions.items() if LAUNCHES.search(code)}
        calls = launching & helpers
        if calls:
            names = "|".join(sorted(calls))
            call = re.compile(rf"\b(?:{names})\(")
            launching |= {n for n, code in functions.items() if call.search(code)}
        _launchers[module.__name__] = launching
    return _launchers[module.__name__]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks ``processes`` every test whose own code (or a helper of its module that it calls)
    launches a process or imports Horovod, as the test files mark those that launch through
    fixtures; then orders the files, those with the most such tests first, then the most tests
    (``make test`` turns xdist's own reordering off): each file stays on one worker, and the
    long ones start while the short ones can still fill the gaps."""
    for item in items:
        function = getattr(item, "function", None)
        if function is not None and item.module is not None:
            if getattr(item, "originalname", item.name) in _launching_functions(item.module):
                item.add_marker(pytest.mark.processes)
    tests: dict = {}
    launching: dict = {}
    for item in items:
        tests[item.path] = tests.get(item.path, 0) + 1
        if item.get_closest_marker("processes"):
            launching[item.path] = launching.get(item.path, 0) + 1
    rank = {path: (-launching.get(path, 0), -count) for path, count in tests.items()}
    items.sort(key=lambda item: rank[item.path])
