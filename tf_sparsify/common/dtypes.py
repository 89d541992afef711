"""The dtypes the package works with, listed once."""

from __future__ import annotations

import tensorflow as tf

#: gradients we compress, and the values TopK and QSGD carry
FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
#: indices of the ops' sparse payloads
INDEX_DTYPES = (tf.int32, tf.int64)
#: the 16-bit wire formats of the casts
WIRE_DTYPES = (tf.float16, tf.bfloat16)


def dtype_bytes(dtype: tf.DType) -> int:
    """Bytes of one element of ``dtype``."""
    return tf.as_dtype(dtype).size
