"""Auto's decisions in a benchmark job: the ``AutoCompression`` callback a trainer drives
itself (``train_on_batch`` runs no callbacks) and what its result record says of them."""

from __future__ import annotations

from typing import Any

import keras

import tf_sparsify as tfs


def auto_for(
    compressor: tfs.Compressor, model: keras.Model, interval: int
) -> tfs.AutoCompression | None:
    """An ``AutoCompression`` deciding every ``interval`` steps, bound to ``model``, when
    ``compressor`` is ``Auto``."""
    if not isinstance(compressor, tfs.Auto):
        return None
    auto = tfs.AutoCompression(interval=interval)
    auto.set_model(model)
    return auto


def driven_auto_for(
    compressor: tfs.Compressor, model: keras.Model, interval: int
) -> tfs.AutoCompression | None:
    """:func:`auto_for`, begun: for a trainer that steps with ``train_on_batch`` (which runs
    no callbacks) and calls ``on_train_batch_end`` after each step itself."""
    auto = auto_for(compressor, model, interval)
    if auto is not None:
        auto.on_train_begin()
    return auto


def auto_summary(auto: tfs.AutoCompression) -> dict[str, Any]:
    """Auto's last decision: its settings per unit, the predicted and measured step."""
    if not auto.decisions:
        return {"auto_decisions": 0}
    last = auto.decisions[-1]
    return {
        "auto_decisions": len(auto.decisions),
        "auto_settings": list(last.settings),
        "auto_predicted_ms": 1e3 * last.predicted,
        "auto_measured_ms": 1e3 * last.measured,
        "auto_overhead_s": auto.overhead,
    }
