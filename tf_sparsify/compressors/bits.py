"""Bit packing of small codes (1 or 2 bits) into uint8, little-endian."""

from __future__ import annotations

import tensorflow as tf


def packed_size(num_elements: int, bits: int) -> int:
    """Bytes needed for ``num_elements`` codes of ``bits`` bits."""
    per_byte = 8 // bits
    return -(-num_elements // per_byte)


def pack(codes: tf.Tensor, bits: int) -> tf.Tensor:
    """Pack a flat tensor of codes in ``[0, 2**bits)`` into ``uint8``."""
    per_byte = 8 // bits
    codes = tf.cast(codes, tf.int32)
    pad = (-tf.size(codes)) % per_byte
    grouped = tf.reshape(tf.pad(codes, [[0, pad]]), [-1, per_byte])
    shifts = tf.range(per_byte, dtype=tf.int32) * bits
    return tf.cast(tf.reduce_sum(tf.bitwise.left_shift(grouped, shifts), axis=1), tf.uint8)


def unpack(packed: tf.Tensor, bits: int, num_elements: int) -> tf.Tensor:
    """Inverse of :func:`pack`: ``num_elements`` int32 codes."""
    per_byte = 8 // bits
    shifts = tf.range(per_byte, dtype=tf.int32) * bits
    wide = tf.bitwise.right_shift(tf.cast(packed, tf.int32)[:, None], shifts)
    codes = tf.bitwise.bitwise_and(wide, (1 << bits) - 1)
    return tf.reshape(codes, [-1])[:num_elements]
