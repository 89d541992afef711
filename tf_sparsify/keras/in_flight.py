"""The update still in flight when ``fit`` ends (``late_buckets``): applied on every replica,
so no gradient is lost (:mod:`tf_sparsify.core.late`)."""

from __future__ import annotations

import weakref

import tensorflow as tf

from tf_sparsify.keras.wrapped import find_sparsified

#: per model, the train function its flush was traced with (a weak reference) and the flush
_FLUSHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def apply_at_fit_end(model) -> None:
    """Apply ``model``'s in-flight update in its strategy's replica context (every worker and
    replica runs it, as they ran ``fit``); nothing without late buckets. The flush is traced
    once per train function: again only when Keras' step was retraced (its plan may differ)."""
    optimizer = find_sparsified(getattr(model, "optimizer", None))
    if optimizer is None or optimizer.pipeline.options.late_buckets == "none":
        return
    train_function = model.train_function
    traced_with, flush = _FLUSHES.get(model, (None, None))
    if flush is None or traced_with() is not train_function:
        strategy = model.distribute_strategy
        flush = tf.function(lambda: strategy.run(optimizer.apply_in_flight))
        _FLUSHES[model] = (weakref.ref(train_function), flush)
    flush()
