"""TensorBoard scalars written without the ``tensorboard`` package (TF 2.21 does not pull it)."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.core.framework import summary_pb2


def write_scalar(tag: str, value: float, step: int) -> None:
    """A TensorBoard scalar summary in the default writer, without the ``tensorboard`` package
    (``tf.summary.scalar`` needs it; the event format only needs the scalars plugin name)."""
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="scalars")
    )
    tf.summary.write(tag, tf.constant(value, tf.float32), step=step, metadata=metadata)
