"""The non-finite rule's two tensor helpers, shared by every layer that must agree on a bad
step (see :mod:`tf_sparsify.compressors.error_memory`)."""

from __future__ import annotations

import tensorflow as tf


def all_finite(tensor: tf.Tensor) -> tf.Tensor:
    """Whether every entry of ``tensor`` is finite (a scalar bool)."""
    return tf.reduce_all(tf.math.is_finite(tensor))


def mark_non_finite(tensor: tf.Tensor, ok: tf.Tensor) -> tf.Tensor:
    """``tensor`` unchanged when ``ok``, all NaN otherwise (so a later check sees the bad step)."""
    return tensor + tf.cast(tf.where(ok, 0.0, float("nan")), tensor.dtype)
