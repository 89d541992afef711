"""The optimizer built before the first trace of the train step.

Without a distribution strategy Keras builds a model's metrics and optimizer inside the first
trace of its train step, and a ``tf.function`` that creates variables while it is traced is
traced again: two or three traces of the whole step (forward, backward, the compression
pipeline) where one does. Under a strategy Keras builds them first (its symbolic build);
``fit`` and ``train_on_batch`` of a model compiled with a
:class:`~tf_sparsify.SparsifiedOptimizer` do the same without one, from the input's shapes (no
batch is read). A model not built yet, or one whose build from the shapes fails (the error
comes from the first trace then, as without this), is left to Keras' own lazy build.
"""

from __future__ import annotations

from tf_sparsify.keras import keras_private
from tf_sparsify.keras.wrapped import find_sparsified


def build_before_first_trace(model, iterator=None, data_batch=None) -> None:
    """Build ``model``'s metrics, loss and optimizer from the shapes of ``data_batch`` (a
    batch) or of the batches ``iterator`` (Keras' epoch iterator) yields, when no strategy
    builds them and the model itself is built."""
    optimizer = getattr(model, "optimizer", None)
    if keras_private.model_strategy(model) is not None or not model.built:
        return
    if find_sparsified(optimizer) is None or optimizer.built:
        return
    if data_batch is None:
        data_batch = keras_private.batch_spec(iterator)
    try:
        keras_private.symbolic_build(model, data_batch)
    except Exception:  # e.g. an input the shapes alone cannot stand for
        return  # Keras builds what is left in the first trace, and raises there as before
