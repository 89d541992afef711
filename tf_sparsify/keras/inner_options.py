"""The options of Keras' base optimizer, which a wrapper hands to the optimizer it wraps.

A :class:`~tf_sparsify.SparsifiedOptimizer` applies updates through its inner optimizer, so
``weight_decay``, ``clipnorm``, ``use_ema``, ... belong there: the wrapper refuses them as its
own arguments and reads and writes them through to the inner optimizer.
"""

from __future__ import annotations

#: the options of Keras' base optimizer, each the inner optimizer's
INNER_OPTIONS = (
    "weight_decay",
    "clipnorm",
    "clipvalue",
    "global_clipnorm",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


class _InnerOption:
    """An option of the inner optimizer, read and written through the wrapper.

    Keras' own wrappers (``LossScaleOptimizer``, ``MultiOptimizer``) and callbacks
    (``SwapEMAWeights``) read and set these on the optimizer they hold; the wrapper passes them
    on so they reach the optimizer that applies the update. Writes before the inner optimizer is
    attached (the defaults Keras' constructor sets) are ignored.
    """

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        inner = obj.__dict__.get("inner_optimizer")
        return None if inner is None else getattr(inner, self.name)

    def __set__(self, obj, value) -> None:
        inner = obj.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, self.name, value)


def read_through(cls: type) -> type:
    """Class decorator: every option of :data:`INNER_OPTIONS` on ``cls`` reads and writes its
    ``inner_optimizer``'s."""
    for name in INNER_OPTIONS:
        setattr(cls, name, _InnerOption(name))
    return cls
