"""Keras' own sparse-gradient optimizer tests (``keras/src/optimizers/optimizer_sparse_test.py``,
38 cases), with every Keras optimizer wrapped in ``SparsifiedOptimizer(..., Identity())`` (the
plugin ``tests/keras_suite/wrap_keras_optimizers.py``), run in a new process (a fork of a warm
interpreter, :func:`tests.script_runner.run_forked`).

With Identity passing IndexedSlices through, the only case that fails is the one that finds
the optimizer to instrument by class: ``LossScaleOptimizer(SGD)`` becomes
``LossScaleOptimizer(SparsifiedOptimizer(SGD))`` and Keras' test instruments the optimizer one
level inside the ``LossScaleOptimizer`` (``isinstance``), which is now the wrapper, not the SGD
that writes. The cases of the optimizers that write a sparse gradient sparsely (SGD, Adadelta,
Adafactor, Adagrad, RMSprop) pass only because Identity passes IndexedSlices through: with
Identity densifying, as the pipeline used to, they fail too.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ElementTree

import keras
import pytest

from tests.script_runner import run_forked

pytestmark = pytest.mark.processes  # Keras's own tests in a subprocess

SUITE = os.path.join(
    os.path.dirname(keras.__file__), "src", "optimizers", "optimizer_sparse_test.py"
)
PYTEST = os.path.join(os.path.dirname(pytest.__file__), "__main__.py")
CASES = 38
#: fails on class identity: Keras' test instruments ``LossScaleOptimizer.inner_optimizer``
CLASS_IDENTITY = {"test_sparse_gradients_loss_scale_optimizer_sgd"}


def failures(tmp_path) -> tuple[int, set[str]]:
    """``(cases run, names of the failed ones)`` of Keras' suite, every optimizer wrapped."""
    report = tmp_path / "suite.xml"
    argv = ["-q", "-p", "no:cacheprovider", "-p", "tests.keras_suite.wrap_keras_optimizers"]
    proc = run_forked(PYTEST, [*argv, f"--junitxml={report}", SUITE], timeout=600)
    assert report.exists(), f"Keras' suite did not run:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    cases = ElementTree.parse(report).getroot().iter("testcase")
    run, failed = 0, set()
    for case in cases:
        run += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(case.get("name"))
    return run, failed


def test_wrapped_keras_sparse_suite_fails_only_on_class_identity(tmp_path):
    assert failures(tmp_path) == (CASES, CLASS_IDENTITY)
