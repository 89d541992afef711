"""Chains of wrapped Keras optimizers, walked in one place.

A Keras optimizer that wraps another holds it as ``inner_optimizer`` (``LossScaleOptimizer``,
:class:`~tf_sparsify.SparsifiedOptimizer` and its Horovod and server variants), so a model's
optimizer is a chain such as ``LossScaleOptimizer(SparsifiedOptimizer(SGD()))``. Whatever in
tf_sparsify looks down such a chain (for the SparsifiedOptimizer in it, a loss scale, the
optimizer at the bottom) does it with :func:`chain`.
"""

from __future__ import annotations

from collections.abc import Iterator

import keras

from tf_sparsify.core.state_views import StateViews
from tf_sparsify.keras import keras_private


def chain(optimizer) -> Iterator:
    """``optimizer``, then the optimizer it wraps, and so on down (nothing for ``None``)."""
    while optimizer is not None:
        yield optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)


def find(optimizer, kind: type):
    """The outermost optimizer of the chain that is a ``kind``, or ``None``."""
    return next((o for o in chain(optimizer) if isinstance(o, kind)), None)


def find_sparsified(optimizer):
    """The SparsifiedOptimizer in a chain of wrappers (e.g. under a LossScaleOptimizer):
    the Keras optimizer in it that holds a compression state; ``None`` if there is none."""
    return next((o for o in chain(optimizer) if _holds_compression_state(o)), None)


def depth(optimizer, inner) -> int:
    """How many wrappers ``inner`` is below ``optimizer`` (0: it is ``optimizer``)."""
    for level, candidate in enumerate(chain(optimizer)):
        if candidate is inner:
            return level
    raise ValueError(f"{inner!r} is not in the optimizer chain of {optimizer!r}")


def innermost(optimizer):
    """The optimizer at the bottom of the chain (the one no other optimizer is inside)."""
    *_, last = chain(optimizer)
    return last


def skip_gradient_all_reduce(optimizer: keras.optimizers.Optimizer):
    """``optimizer`` (returned) without the dense gradient all-reduce Keras' TF optimizers run
    in a replica context, down its whole chain: for custom loops under ``tf.distribute``
    whose gradients a :class:`tf_sparsify.GradientExchange` has already exchanged."""
    for part in chain(optimizer):
        keras_private.disable_dense_all_reduce(part)
    return optimizer


def _holds_compression_state(optimizer) -> bool:
    return isinstance(optimizer, StateViews) and isinstance(optimizer, keras.optimizers.Optimizer)
