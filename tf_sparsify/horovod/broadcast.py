"""Broadcast of Keras 3 (and plain TF) variables from one rank to all."""

from __future__ import annotations

from collections.abc import Iterable

import keras
import tensorflow as tf

from tf_sparsify.horovod._hvd import hvd


def broadcast_variables(variables: Iterable, root_rank: int = 0) -> None:
    """Set every rank's ``variables`` to ``root_rank``'s values.

    ``hvd.broadcast_variables`` needs ``tf.Variable``s and fails on Keras 3 variables; their
    backing ``tf.Variable`` (``.value`` outside an autocast scope) is broadcast instead.
    """
    targets = [_tf_variable(v) for v in variables]
    if targets:
        hvd.broadcast_variables(targets, root_rank=root_rank)


def _tf_variable(variable) -> tf.Variable:
    if isinstance(variable, keras.Variable):
        variable = variable.value
    if not isinstance(variable, tf.Variable):
        raise ValueError(f"Expected a Keras or TF variable; received {variable!r}")
    return variable
