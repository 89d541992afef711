"""P workers simulated on one device: a Keras model that splits batches (and, re-exported, the
collective of one simulated worker).

Keras' ``train_step`` computes one gradient per batch. :class:`SimulatedWorkers` wraps a model so
that ``fit`` splits each batch into ``P`` contiguous parts, computes each part's gradient of its
own mean loss, and hands the optimizer the stacked gradients (``[P, *shape]`` per variable). A
:class:`~tf_sparsify.distribute.ServerOptimizer` built with ``workers=P`` runs the pipeline
once per simulated worker, each through its :class:`SimulatedWorkerCollective`, so each worker
has its own residuals and random keys: the same numbers a P-replica ``MirroredStrategy`` run on
the same split would produce. Custom loops pass stacked gradients to ``optimizer.apply``.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras import tree

from tf_sparsify.collectives import SimulatedWorkerCollective
from tf_sparsify.keras.wrapped import find_sparsified

__all__ = ["SimulatedWorkerCollective", "SimulatedWorkers"]


class SimulatedWorkers(keras.Model):
    """Train ``model`` as ``P`` workers, ``P`` being the ``workers`` of its ServerOptimizer.

    Compile this wrapper (not the inner model) with a ``ServerOptimizer(..., workers=P)``. A batch
    of ``B`` rows is cut into ``P`` contiguous parts of ``B // P`` or ``B // P + 1`` rows (use
    batches of at least ``P`` rows); each worker's gradient is that of its part's mean loss, so
    the synchronous update is their average. Loss and metrics are reported for the whole batch.
    Save or checkpoint the inner model and the optimizer as usual (the wrapper adds no weights).
    """

    def __init__(self, model: keras.Model, **kwargs):
        super().__init__(**kwargs)
        self.model = model

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def num_workers(self) -> int:
        optimizer = find_sparsified(self.optimizer)
        workers = getattr(optimizer, "simulated_workers", None)
        if workers is None:
            raise ValueError(
                "SimulatedWorkers needs a model compiled with a ServerOptimizer(..., workers=P); "
                f"received optimizer={self.optimizer!r}"
            )
        return workers

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        workers = self.num_workers()
        rows = tf.shape(tree.flatten(x)[0])[0]
        grads, predictions = [], []
        for p in range(workers):
            lo, hi = (p * rows) // workers, ((p + 1) * rows) // workers

            def part(t, lo=lo, hi=hi):
                return None if t is None else t[lo:hi]

            xp, yp, wp = (tree.map_structure(part, t) for t in (x, y, sample_weight))
            with tf.GradientTape() as tape:
                y_pred = self(xp, training=True)
                loss = self.compute_loss(x=xp, y=yp, y_pred=y_pred, sample_weight=wp)
                scaled = self.optimizer.scale_loss(loss)
            grads.append(tape.gradient(scaled, self.trainable_variables))
            predictions.append(y_pred)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss, sample_weight=hi - lo)
        stacked = [
            None
            if any(g is None for g in column)
            else tf.stack([tf.convert_to_tensor(g) for g in column])
            for column in zip(*grads, strict=True)
        ]
        self.optimizer.apply(stacked, self.trainable_variables)
        y_pred = tree.map_structure(lambda *parts: tf.concat(parts, axis=0), *predictions)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
