"""The Keras private APIs tf_sparsify needs live in ``tf_sparsify.keras.keras_private`` only,
and a Keras upgrade that moves one of them fails here with one clear message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from keras.src.optimizers import base_optimizer

from tf_sparsify.keras import keras_private

PACKAGE = Path(__file__).resolve().parents[1] / "tf_sparsify"
#: private Keras optimizer attributes and modules that only keras_private.py may touch
PRIVATE = re.compile(
    r"keras\.src|\._(iterations|trainable_variables|all_reduce_sum_gradients|var_key|"
    r"get_variable_index|check_variables_are_known|filter_empty_gradients|track_variable|"
    r"distribution_strategy|distribute_strategy|maybe_symbolic_build|symbolic_build|"
    r"weights_path|training_metadata_path|prev_weights_path|prev_training_metadata_path|"
    r"resolve_auto_jit_compile)\b"
)


def test_this_keras_has_every_private_api_we_use():
    keras_private.check()


def test_a_moved_private_api_is_named(monkeypatch):
    monkeypatch.delattr(base_optimizer.BaseOptimizer, "_filter_empty_gradients")
    with pytest.raises(RuntimeError, match="moved private APIs.*_filter_empty_gradients"):
        keras_private.check()


def test_a_moved_trainer_api_is_named(monkeypatch):
    from keras.src.backend.tensorflow import trainer

    monkeypatch.delattr(trainer.TensorFlowTrainer, "_maybe_symbolic_build")
    monkeypatch.delattr(trainer, "reduce_per_replica")
    with pytest.raises(
        RuntimeError, match=r"TensorFlowTrainer\._maybe_symbolic_build.*reduce_per_replica"
    ):
        keras_private.check()


def test_no_module_but_keras_private_touches_keras_private_apis():
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "keras_private.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert offenders == []


def test_theory_does_not_import_distribute():
    source = (PACKAGE / "analysis" / "theory.py").read_text()
    assert "tf_sparsify.distribute" not in source
