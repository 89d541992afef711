"""Keras 3 callbacks for Horovod: start from the same weights, report averaged metrics."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_sparsify.horovod._hvd import hvd
from tf_sparsify.horovod.broadcast import broadcast_variables
from tf_sparsify.horovod.error_memory import scatter_error_memory
from tf_sparsify.keras.wrapped import find_sparsified


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcast the model's and the optimizer's variables from ``root_rank`` once.

    Without a ``tf.distribute`` strategy Keras builds the optimizer only when the train step
    is first traced, inside the first batch. So at train begin this callback builds the
    optimizer on the model's trainable variables itself, then broadcasts everything before
    the first step. A model not built by then (subclassed, no input shape) is broadcast after
    the first batch instead. Each rank's residuals, momentum buffers, gradients in flight
    (``late_buckets``) and diagnostics are its own and are not broadcast; when the
    root alone restored a checkpoint holding every rank's
    (:func:`~tf_sparsify.horovod.gather_error_memory`), each rank gets its own row from it.
    """

    def __init__(self, root_rank: int = 0):
        super().__init__()
        self.root_rank = root_rank
        self.done = False

    def on_train_begin(self, logs=None):
        if not self.done and self.model.built:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.done:
            self._broadcast()

    def _broadcast(self) -> None:
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)
        variables = list(self.model.variables)
        if optimizer is not None:
            variables += _shared(optimizer)
        broadcast_variables(variables, self.root_rank)
        if find_sparsified(optimizer) is not None:
            scatter_error_memory(optimizer, self.root_rank)
        self.done = True


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's numeric logs by their average over ranks (one all-reduce).

    Put it first in ``callbacks`` so the others (and ``History`` and the progress bar, which
    Keras appends last) see the averages. All ranks must log the same keys.
    """

    def on_epoch_end(self, epoch, logs=None):
        keys = sorted(k for k, v in (logs or {}).items() if _is_number(v))
        if not keys:
            return
        values = tf.constant([float(logs[k]) for k in keys], tf.float64)
        means = hvd.allreduce(values, op=hvd.Average, name="tf_sparsify_metric_average")
        logs.update(zip(keys, means.numpy().tolist(), strict=True))


def _shared(optimizer) -> list:
    """The optimizer's variables without those each rank holds its own of (residuals, momenta,
    gradients in flight, diagnostics: what :func:`scatter_error_memory` hands out per rank)."""
    sparsified = find_sparsified(optimizer)
    own = {} if sparsified is None else sparsified.exchange_checkpoint.per_replica_keys()
    return [v for v in optimizer.variables if id(v) not in own]


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
