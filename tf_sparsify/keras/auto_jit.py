"""Keras' ``jit_compile="auto"`` for models whose optimizer step XLA cannot compile.

``model.compile`` resolves ``"auto"`` to XLA where a GPU is visible and no ``tf.distribute``
strategy is used. A :class:`~tf_sparsify.keras.SparsifiedOptimizer` whose step cannot run under
XLA (``runs_under_xla`` False: Horovod's optimizer, a ``SparseAllReduce`` compressor) makes it
resolve to ``False`` instead; ``jit_compile=True`` then fails at the first step with a
ValueError naming ``jit_compile=False``. Every other model resolves as Keras decides.
"""

from __future__ import annotations

import functools

from tf_sparsify.keras import keras_private
from tf_sparsify.keras.wrapped import find_sparsified


def needs_no_xla(optimizer) -> bool:
    """Whether ``optimizer``, or an optimizer it wraps, cannot run under XLA."""
    sparsified = find_sparsified(optimizer)
    return sparsified is not None and not sparsified.runs_under_xla


@functools.cache
def install() -> None:
    """Make Keras resolve ``"auto"`` to ``False`` for a model whose optimizer
    :func:`needs_no_xla` (once per process)."""

    def wrap(resolve):
        @functools.wraps(resolve)
        def resolve_auto_jit_compile(model) -> bool:
            if needs_no_xla(getattr(model, "optimizer", None)):
                return False
            return resolve(model)

        return resolve_auto_jit_compile

    keras_private.wrap_auto_jit_compile(wrap)
