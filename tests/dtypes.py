"""The ops' float dtypes, their names in the NumPy reference, and unsigned ints of their width."""

from __future__ import annotations

import tensorflow as tf

KIND = {
    tf.float16: "float16",
    tf.bfloat16: "bfloat16",
    tf.float32: "float32",
    tf.float64: "float64",
}
UINT = {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}
DTYPES = list(KIND)
