"""Bit packing into uint8, little-endian: small codes (1 or 2 bits) and sorted index sets."""

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


# -- sorted index sets (Elias-Fano) -------------------------------------------------------------
#: widest low part of an index (in bits): fields of at most 32 bits keep the arithmetic in int64
MAX_LOW_BITS = 32


def index_code_split(num_elements: int, k: int) -> tuple[int, int]:
    """``(low_bits, high_bits)`` of the code for ``k`` sorted distinct indices in
    ``[0, num_elements)``: ``k * low_bits`` bits of low parts, then a ``high_bits``-bit map.

    ``low_bits`` minimizes the total ``k * L + ((n - 1) >> L) + k`` over
    ``0 <= L <= min(ceil(log2 n), 32)`` (ties to the larger ``L``: fewer bits to scan): at most
    ``k * (2 + ceil(log2(n / k)))`` bits while ``n / k <= 2**32``.
    """
    if k == 0:
        return 0, 0
    widest = min((num_elements - 1).bit_length(), MAX_LOW_BITS)
    low = min(range(widest + 1), key=lambda b: (k * b + ((num_elements - 1) >> b), -b))
    return low, ((num_elements - 1) >> low) + k


def index_code_bytes(num_elements: int, k: int) -> int:
    """Bytes of :func:`encode_indices`' code for ``k`` of ``num_elements`` indices (Python
    ints only: exact for any size, nothing allocated)."""
    low, high = index_code_split(num_elements, k)
    return -(-(k * low + high) // 8)


def encode_indices(indices: tf.Tensor, num_elements: int) -> tf.Tensor:
    """Elias-Fano code of flat ascending distinct ``indices`` in ``[0, num_elements)``: uint8
    of :func:`index_code_bytes` bytes, bits little-endian.

    Index ``j`` (value ``x``) puts ``x mod 2**L`` at bit ``j * L`` and a 1 at bit
    ``k * L + (x >> L) + j``; the rest is 0. Its size depends on ``num_elements`` and ``k`` only.
    """
    k = int(indices.shape[0])
    low, _ = index_code_split(num_elements, k)
    x = tf.cast(indices, tf.int64)
    j = tf.range(k, dtype=tf.int64)
    ids, parts = _field_bytes(tf.bitwise.bitwise_and(x, (1 << low) - 1), j * low, low)
    high_ids, high_parts = _field_bytes(
        tf.ones_like(x), k * low + tf.bitwise.right_shift(x, low) + j, 1
    )
    size = index_code_bytes(num_elements, k)
    summed = tf.math.unsorted_segment_sum(  # the fields are disjoint: their sum is their OR
        tf.concat([parts, high_parts], 0), tf.concat([ids, high_ids], 0), size + 8
    )
    return tf.cast(summed[:size], tf.uint8)


def decode_indices(code: tf.Tensor, num_elements: int, k: int, dtype: tf.DType) -> tf.Tensor:
    """Inverse of :func:`encode_indices` on the last axis: ``code[..., bytes]`` gives the
    ``[..., k]`` indices in ``dtype`` (a gathered ``[replicas, bytes]`` code works as it is)."""
    code = tf.convert_to_tensor(code)
    _check_code(code, num_elements, k)
    low, high = index_code_split(num_elements, k)
    lows = _read_fields(code, tf.range(k, dtype=tf.int64) * low, low)
    bits = _read_fields(code, k * low + tf.range(high, dtype=tf.int64), 1)
    j = tf.range(k, dtype=tf.int64)
    ones_seen = tf.cumsum(bits, axis=-1)  # the j-th 1 is where the count first reaches j + 1
    wanted = tf.broadcast_to(j + 1, tf.concat([tf.shape(code)[:-1], [k]], 0))
    position = tf.searchsorted(ones_seen, wanted, side="left", out_type=tf.int64)
    indices = tf.bitwise.bitwise_or(tf.bitwise.left_shift(position - j, low), lows)
    return tf.cast(indices, dtype)


def _check_code(code: tf.Tensor, num_elements: int, k: int) -> None:
    """ValueError naming ``code`` unless it is uint8 with the code's size on its last axis."""
    size = index_code_bytes(num_elements, k)
    if code.dtype != tf.uint8 or code.shape.rank in (None, 0) or code.shape[-1] != size:
        raise ValueError(
            f"`code` must be uint8 with {size} bytes on its last axis (k={k} of "
            f"{num_elements} indices); received dtype={code.dtype.name}, shape={code.shape}"
        )


def _field_bytes(values: tf.Tensor, offsets: tf.Tensor, width: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(byte ids, byte parts)`` that write ``width``-bit ``values`` at bit ``offsets``."""
    touched = (width + 6) // 8 + 1  # bytes a field can touch, at any offset within a byte
    shifted = tf.bitwise.left_shift(values, tf.bitwise.bitwise_and(offsets, 7))
    steps = tf.range(touched, dtype=tf.int64)
    parts = tf.bitwise.bitwise_and(tf.bitwise.right_shift(shifted[:, None], 8 * steps), 255)
    ids = tf.bitwise.right_shift(offsets, 3)[:, None] + steps
    return tf.reshape(ids, [-1]), tf.cast(tf.reshape(parts, [-1]), tf.int32)


def _read_fields(code: tf.Tensor, offsets: tf.Tensor, width: int) -> tf.Tensor:
    """The ``width``-bit fields at bit ``offsets`` of ``code[..., bytes]``: int64 ``[..., m]``."""
    touched = (width + 6) // 8 + 1
    rank = code.shape.rank
    padded = tf.pad(tf.cast(code, tf.int64), [[0, 0]] * (rank - 1) + [[0, touched]])
    steps = tf.range(touched, dtype=tf.int64)
    ids = tf.bitwise.right_shift(offsets, 3)[:, None] + steps
    chunks = tf.gather(padded, ids, axis=-1)  # [..., m, touched]
    words = tf.reduce_sum(tf.bitwise.left_shift(chunks, 8 * steps), axis=-1)
    fields = tf.bitwise.right_shift(words, tf.bitwise.bitwise_and(offsets, 7))
    return tf.bitwise.bitwise_and(fields, (1 << width) - 1)
