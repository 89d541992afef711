"""The options and state of Keras' base optimizer, which a wrapper hands to the optimizer it
wraps.

A :class:`~tf_sparsify.SparsifiedOptimizer` applies updates through its inner optimizer, so
``weight_decay``, ``clipnorm``, ``use_ema``, ... belong there: the wrapper refuses them as its
own arguments and reads and writes them through to the inner optimizer. So do the learning
rate, the step count and the EMA of the model variables, as on Keras' ``LossScaleOptimizer``.
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
#: the inner optimizer's state, also read (and, the learning rate, written) through the wrapper;
#: ``_model_variables_moving_average`` is read by ``keras.callbacks.SwapEMAWeights``
INNER_STATE = ("learning_rate", "iterations", "_model_variables_moving_average")


def refuse(kwargs: dict, wrapper: str) -> None:
    """ValueError for an option of :data:`INNER_OPTIONS` given to the wrapper itself."""
    for option in INNER_OPTIONS:
        if option in kwargs:
            raise ValueError(
                f"{wrapper} does not take `{option}` (received {option}={kwargs[option]!r}): "
                "set it on the inner optimizer, where it acts on the averaged, decompressed "
                "update."
            )


class _InnerOption:
    """An option (or state) of the inner optimizer, read and written through the wrapper.

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
    """Class decorator: every name of :data:`INNER_OPTIONS` and :data:`INNER_STATE` on ``cls``
    reads and writes its ``inner_optimizer``'s."""
    for name in INNER_OPTIONS + INNER_STATE:
        setattr(cls, name, _InnerOption(name))
    return cls
