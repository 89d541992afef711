"""The update still in flight when ``fit`` ends (``late_buckets``): applied on every replica,
so no gradient is lost (:mod:`tf_sparsify.core.late`)."""

from __future__ import annotations

import tensorflow as tf

from tf_sparsify.keras.wrapped import find_sparsified


def apply_at_fit_end(model) -> None:
    """Apply ``model``'s in-flight update in its strategy's replica context (every worker and
    replica runs it, as they ran ``fit``); nothing without late buckets."""
    optimizer = find_sparsified(getattr(model, "optimizer", None))
    if optimizer is None or optimizer.pipeline.options.late_buckets == "none":
        return
    strategy = model.distribute_strategy
    tf.function(lambda: strategy.run(optimizer.apply_in_flight))()  # traced: once per fit
