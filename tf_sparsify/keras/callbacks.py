"""Keras callbacks that put the communication statistics into ``history`` and TensorBoard."""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_sparsify.keras.summaries import write_scalar
from tf_sparsify.keras.wrapped import find_sparsified


class CompressionStats(keras.callbacks.Callback):
    """Adds, per epoch, the bytes one replica sent and the compression ratio to the logs.

    Keys: ``bytes_per_step`` (wire bytes per step and replica, averaged over the epoch),
    ``dense_bytes_per_step``, ``compression_ratio`` (dense / wire), ``cumulative_bytes``
    (since the optimizer was built). Place it before ``TensorBoard`` in the callback list, or
    give ``log_dir`` to write the same scalars as summaries.
    """

    def __init__(self, log_dir: str | None = None):
        super().__init__()
        self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        self._start = (0, 0, 0)

    def _counters(self) -> tuple[int, int, int]:
        opt = find_sparsified(self.model.optimizer)
        if opt is None or not opt.built:
            raise ValueError("CompressionStats needs a model compiled with a SparsifiedOptimizer.")
        return (
            int(opt.bytes_sent.numpy()),
            int(opt.dense_bytes.numpy()),
            int(opt.exchange_steps.numpy()),
        )

    def on_epoch_begin(self, epoch, logs=None):
        opt = find_sparsified(self.model.optimizer)
        self._start = self._counters() if opt is not None and opt.built else (0, 0, 0)

    def on_epoch_end(self, epoch, logs=None):
        sent, dense, steps = self._counters()
        d_sent, d_dense, d_steps = (
            a - b for a, b in zip((sent, dense, steps), self._start, strict=True)
        )
        stats = {
            "bytes_per_step": d_sent / max(d_steps, 1),
            "dense_bytes_per_step": d_dense / max(d_steps, 1),
            "compression_ratio": d_dense / max(d_sent, 1),
            "cumulative_bytes": float(sent),
        }
        if logs is not None:
            logs.update(stats)
        if self._writer is not None:
            with self._writer.as_default(step=epoch):
                for key, value in stats.items():
                    write_scalar(f"compression/{key}", value, epoch)
            self._writer.flush()
