"""pytest plugin: Keras' own optimizer tests, every Keras optimizer wrapped.

Loaded by ``tests/test_keras_sparse_suite.py`` (``-p tests.keras_suite.wrap_keras_optimizers``)
when it runs Keras' test files in a new process. Each optimizer class of ``keras.optimizers``
becomes a subclass of ``SparsifiedOptimizer`` that wraps the original with ``tfs.Identity()``.

Keras' sparse-gradient test instruments the optimizer that writes: ``optimizer.inner_optimizer``
when ``isinstance(optimizer, LossScaleOptimizer)``, else the optimizer itself. The plugin lets
that check count a ``SparsifiedOptimizer`` as a wrapper too (Keras' ``LossScaleOptimizer`` is
still what the name constructs), so the inner optimizer is the one instrumented.
"""

from __future__ import annotations

import importlib

from keras.src import optimizers
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

import tf_sparsify as tfs

#: the wrapped classes and their modules
CLASSES = {
    "SGD": "sgd",
    "Adam": "adam",
    "AdamW": "adamw",
    "Adadelta": "adadelta",
    "Adafactor": "adafactor",
    "Adagrad": "adagrad",
    "Adamax": "adamax",
    "Ftrl": "ftrl",
    "Lamb": "lamb",
    "Lion": "lion",
    "Nadam": "nadam",
    "RMSprop": "rmsprop",
}


def wrapped(cls: type) -> type:
    """A SparsifiedOptimizer class that takes ``cls``'s arguments and wraps a ``cls``."""

    class Wrapped(tfs.SparsifiedOptimizer):
        def __init__(self, *args, **kwargs):
            super().__init__(cls(*args, **kwargs), tfs.Identity())

    Wrapped.__name__ = Wrapped.__qualname__ = cls.__name__
    return Wrapped


class _Wrappers(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, LossScaleOptimizer | tfs.SparsifiedOptimizer)


class AnyWrapper(metaclass=_Wrappers):
    """``LossScaleOptimizer`` for construction; a SparsifiedOptimizer passes its isinstance."""

    def __new__(cls, *args, **kwargs):
        return LossScaleOptimizer(*args, **kwargs)


def pytest_configure(config) -> None:
    for name, module_name in CLASSES.items():
        module = importlib.import_module(f"keras.src.optimizers.{module_name}")
        replacement = wrapped(getattr(module, name))
        setattr(module, name, replacement)
        setattr(optimizers, name, replacement)
    optimizers.LossScaleOptimizer = AnyWrapper
