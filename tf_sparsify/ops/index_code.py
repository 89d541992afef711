"""The Elias-Fano code of a sorted index set (TopK's payload): its layout and its pure-TF
reference (the ``IndexCodeEncode``/``IndexCodeDecode`` kernels give the same bytes).

Bits are little-endian within and across bytes. With ``L`` low bits and
``H = ((n - 1) >> L) + k`` map bits, index ``j`` (value ``x``) sets bit ``(x >> L) + j`` of the
map (bits ``[0, H)``) and puts ``x mod 2**L`` at bit ``H + j * L``; the rest is 0. The size,
``ceil((H + k * L) / 8)`` bytes (none for ``k = 0``), depends on ``n``, ``k`` and ``L`` only.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tf_sparsify.ops import xla

#: widest low part of an index (in bits): fields of at most 32 bits keep the arithmetic in int64
MAX_LOW_BITS = 32


def low_bits_for(num_elements: int, k: int) -> int:
    """The width ``L`` of the low parts for ``k`` of ``num_elements`` indices.

    ``L`` minimizes the code's bits ``k * L + ((n - 1) >> L) + k`` over
    ``0 <= L <= min(ceil(log2 n), 32)`` (ties to the larger ``L``: fewer bits to scan): at most
    ``k * (2 + ceil(log2(n / k)))`` bits while ``n / k <= 2**32``.
    """
    if k == 0:
        return 0
    widest = min((num_elements - 1).bit_length(), MAX_LOW_BITS)
    return min(range(widest + 1), key=lambda b: (k * b + ((num_elements - 1) >> b), -b))


def map_bits(num_elements: int, k: int, low_bits: int) -> int:
    """Bits of the map (the code's head; ``k`` low parts of ``low_bits`` bits follow)."""
    return ((num_elements - 1) >> low_bits) + k if k else 0


def index_code_bytes(num_elements: int, k: int) -> int:
    """Bytes of the code for ``k`` of ``num_elements`` indices with the default low width
    (Python ints only: exact for any size, nothing allocated)."""
    low = low_bits_for(num_elements, k)
    return -(-(map_bits(num_elements, k, low) + k * low) // 8)


def reference_encode(indices: tf.Tensor, num_elements: int) -> tf.Tensor:
    """Pure-TF ``IndexCodeEncode`` with :func:`low_bits_for`'s width; indices not checked."""
    k = int(indices.shape[0])
    low = low_bits_for(num_elements, k)
    high = map_bits(num_elements, k, low)
    x = tf.cast(indices, tf.int64)
    j = tf.range(k, dtype=tf.int64)
    high_ids, high_parts = _field_bytes(tf.ones_like(x), tf.bitwise.right_shift(x, low) + j, 1)
    ids, parts = _field_bytes(tf.bitwise.bitwise_and(x, (1 << low) - 1), high + j * low, low)
    size = index_code_bytes(num_elements, k)
    summed = tf.math.unsorted_segment_sum(  # the fields are disjoint: their sum is their OR
        tf.concat([parts, high_parts], 0), tf.concat([ids, high_ids], 0), size + 8
    )
    return tf.cast(summed[:size], tf.uint8)


def reference_decode(code: tf.Tensor, num_elements: int, k: int, dtype: tf.DType) -> tf.Tensor:
    """Pure-TF ``IndexCodeDecode``: ``code[..., bytes]`` gives the ``[..., k]`` indices in
    ``dtype`` (static shapes, no host synchronization but the check's flag). A row that is not
    the code of ``k`` strictly ascending indices below ``num_elements`` (see :func:`row_is_valid`)
    fails with InvalidArgumentError naming the first such row; under XLA, where no op can
    fail, nothing is checked."""
    rows = tf.reshape(code, [-1, code.shape[-1]])  # the leading dimensions may be unknown
    low = low_bits_for(num_elements, k)
    high = map_bits(num_elements, k, low)
    j = tf.range(k, dtype=tf.int64)
    position, ones = _ones_positions(rows, high, k)
    lows = _read_fields(rows, high + j * low, low)
    indices = tf.bitwise.bitwise_or(tf.bitwise.left_shift(position - j, low), lows)
    if k and not xla.in_xla_context():
        valid = row_is_valid(rows, indices, ones, num_elements, k)
        message = tf.strings.format(  # names the first invalid row
            f"IndexCodeDecode: code row {{}} is not a valid index code of k = {k} strictly "
            f"ascending indices in [0, {num_elements}) (map ones, order, range or padding bits)",
            tf.argmin(tf.concat([tf.cast(valid, tf.int32), [0]], 0)),  # [0]: rows may be none
        )
        check = tf.debugging.Assert(tf.reduce_all(valid), [message])
        with tf.control_dependencies([check]):
            indices = tf.identity(indices)
    out = tf.reshape(tf.cast(indices, dtype), tf.concat([tf.shape(code)[:-1], [k]], 0))
    out.set_shape(code.shape[:-1].concatenate([k]))
    return out


def row_is_valid(
    code: tf.Tensor, indices: tf.Tensor, ones: tf.Tensor, num_elements: int, k: int
) -> tf.Tensor:
    """Whether each row of ``code[rows, bytes]`` is the code of ``k >= 1`` strictly ascending
    indices below ``num_elements``, given its decoded ``indices[rows, k]`` and the number of
    ``ones`` in its map: then encoding the indices gives the row back. bool ``[rows]``."""
    valid = tf.equal(ones, k) & tf.reduce_all(indices < num_elements, axis=1)
    if k > 1:
        valid &= tf.reduce_all(indices[:, 1:] > indices[:, :-1], axis=1)
    low = low_bits_for(num_elements, k)
    used = map_bits(num_elements, k, low) + k * low
    if used % 8:  # the bits after the last low part, in the last byte, are 0
        valid &= tf.equal(tf.bitwise.right_shift(code[:, -1], used % 8), 0)
    return valid


def _ones_positions(code: tf.Tensor, num_bits: int, k: int) -> tuple[tf.Tensor, tf.Tensor]:
    """Positions of the first ``k`` ones among the first ``num_bits`` bits of each row of
    ``code[rows, bytes]`` (int64 ``[rows, k]``; 0 where a row has fewer) and the number of
    ones there (int32 ``[rows]``): static shapes, no host synchronization.

    Byte by byte: a byte's ones have ranks from the count of ones in the bytes before it (a
    cumulative sum over bytes, not bits) and bit positions from a 256-entry table; each of its
    8 slots that holds a one of rank below ``k`` lands at its rank (the others in a dropped
    segment).
    """
    num_bytes = -(-num_bits // 8)
    mask = [255] * num_bytes
    if num_bits % 8:  # the low parts start inside the last byte of the map
        mask[-1] = (1 << (num_bits % 8)) - 1
    head = tf.bitwise.bitwise_and(tf.cast(code[:, :num_bytes], tf.int32), mask)
    counts = tf.gather(_ONES_IN_BYTE, head)  # [rows, bytes]
    ranks = tf.cumsum(counts, axis=1, exclusive=True)[..., None] + tf.range(8)  # [rows, bytes, 8]
    wide = tf.int32 if 8 * num_bytes < 2**31 else tf.int64
    positions = tf.cast(tf.gather(_ONE_POSITIONS, head), wide)
    positions += tf.range(0, 8 * num_bytes, 8, dtype=wide)[:, None]
    rows = tf.shape(code, out_type=tf.int64)[0]
    slots = tf.range(rows)[:, None, None] * k + tf.cast(ranks, tf.int64)
    kept = (tf.range(8) < counts[..., None]) & (ranks < k)  # a corrupt row's extra ones: dropped
    slots = tf.where(kept, slots, rows * k)  # empty slots: dropped
    found = tf.math.unsorted_segment_sum(positions, slots, rows * k + 1)[:-1]
    return tf.cast(tf.reshape(found, [rows, k]), tf.int64), tf.reduce_sum(counts, axis=1)


#: ones in each byte value, and the bit positions of its ones in increasing order (0-padded);
#: NumPy, not tf.constant: an eager tensor at import would start TensorFlow's context before
#: users configure devices or collectives
_ONES_IN_BYTE = np.array([bin(b).count("1") for b in range(256)], np.int32)
_ONE_POSITIONS = np.array(
    [[t for t in range(8) if b >> t & 1] + [0] * (8 - bin(b).count("1")) for b in range(256)],
    np.int32,
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
    """The ``width``-bit fields at bit ``offsets`` of ``code[rows, bytes]``: int64 ``[rows, m]``.

    Each byte's window of the bytes a field can touch is assembled once (in int32 while it
    fits in 24 bits), then one gather reads every field's window.
    """
    if width == 0:  # no bits to read (its offset may be one past the code)
        return tf.zeros([tf.shape(code)[0], offsets.shape[0]], tf.int64)
    touched = (width + 6) // 8 + 1
    wide = tf.int32 if touched <= 3 else tf.int64
    size = code.shape[1]
    padded = tf.pad(tf.cast(code, wide), [[0, 0], [0, touched]])
    windows = padded[:, :size]
    for t in range(1, touched):
        windows += tf.bitwise.left_shift(padded[:, t : size + t], 8 * t)
    words = tf.gather(windows, tf.bitwise.right_shift(offsets, 3), axis=1)
    fields = tf.bitwise.right_shift(words, tf.cast(tf.bitwise.bitwise_and(offsets, 7), wide))
    return tf.cast(tf.bitwise.bitwise_and(fields, (1 << width) - 1), tf.int64)
