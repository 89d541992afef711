"""The byte view of tensors on the wire: a tensor travels as its bit patterns, ``uint8`` rows
(Horovod takes no bfloat16 and one dtype per grouped op) or packed into ``int32`` words
(tf.distribute's collectives lack some dtypes and run one round per tensor). One view, used by
every collective that sends bytes."""

from __future__ import annotations

import tensorflow as tf


def as_bytes(t: tf.Tensor) -> tf.Tensor:
    """``[rows, bytes per row]`` uint8: the bit patterns of each row of ``t``."""
    if t.shape.rank is None or t.shape.rank < 1 or not t.shape[1:].is_fully_defined():
        raise ValueError(f"rows travel as bytes: a tensor of shape {t.shape} has no fixed rows")
    return tf.reshape(flat_bytes(t), [-1, t.shape[1:].num_elements() * t.dtype.size])


def from_bytes(raw: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`as_bytes` for rows of tensors like ``like`` (any number of rows)."""
    if like.dtype == tf.bool:
        return tf.cast(tf.reshape(raw, [-1, *like.shape[1:]]), tf.bool)
    if like.dtype.size == 1:
        return tf.bitcast(tf.reshape(raw, [-1, *like.shape[1:]]), like.dtype)
    return tf.bitcast(tf.reshape(raw, [-1, *like.shape[1:], like.dtype.size]), like.dtype)


def to_words(t: tf.Tensor) -> tf.Tensor:
    """The bytes of ``t`` (zero-padded to a multiple of 4) as a flat int32 vector."""
    if t.dtype.size % 4 == 0:
        return tf.reshape(tf.bitcast(t, tf.int32), [-1])
    raw = flat_bytes(t)
    pad = (-raw.shape[0]) % 4 if raw.shape[0] is not None else (-tf.size(raw)) % 4
    raw = tf.pad(raw, [[0, pad]])
    return tf.bitcast(tf.reshape(raw, [-1, 4]), tf.int32)


def from_words(gathered: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`to_words` for a ``[replicas, words]`` gather of tensors like ``like``."""
    replicas = tf.shape(gathered)[0]
    shape = tf.concat([[replicas], tf.shape(like)], axis=0)
    size = like.dtype.size
    if size % 4 == 0:
        words = tf.reshape(gathered, [replicas, -1, size // 4])
        values = (
            tf.bitcast(words, like.dtype) if size > 4 else tf.bitcast(words[..., 0], like.dtype)
        )
        return tf.reshape(values, shape)
    raw = tf.reshape(tf.bitcast(gathered, tf.uint8), [replicas, -1])
    raw = tf.reshape(raw[:, : tf.size(like) * size], [replicas, -1, size])
    values = tf.bitcast(raw, like.dtype) if size > 1 else tf.bitcast(raw[..., 0], like.dtype)
    return tf.reshape(values, shape)


def words_for(rows: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """The int32 words :func:`to_words` makes of ``rows`` rows of a tensor like ``like``."""
    row_bytes = like.shape[1:].num_elements() * like.dtype.size
    return (rows * row_bytes + 3) // 4


def rows_from_words(words: tf.Tensor, rows: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Inverse of :func:`to_words` for ``rows`` rows of a tensor like ``like``."""
    shape = tf.concat([[rows], tf.constant(like.shape[1:].as_list(), tf.int32)], axis=0)
    size = like.dtype.size
    if size % 4 == 0:
        values = tf.reshape(words, [-1, size // 4])
        values = tf.bitcast(values, like.dtype) if size > 4 else tf.bitcast(words, like.dtype)
        return tf.reshape(values, shape)
    raw = tf.reshape(tf.bitcast(words, tf.uint8), [-1])
    elements = rows * like.shape[1:].num_elements()
    raw = tf.reshape(raw[: elements * size], [-1, size])
    values = tf.bitcast(raw, like.dtype) if size > 1 else tf.bitcast(raw[..., 0], like.dtype)
    return tf.reshape(values, shape)


def flat_bytes(t: tf.Tensor) -> tf.Tensor:
    """The bit patterns of ``t``, flat ``uint8`` (a bool is one byte)."""
    raw = tf.cast(t, tf.uint8) if t.dtype == tf.bool else tf.bitcast(t, tf.uint8)
    return tf.reshape(raw, [-1])
