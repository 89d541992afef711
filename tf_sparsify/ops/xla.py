"""What changes when ops are traced for XLA (``jit_compile=True``): how to tell, and
TensorFlow's stateless random draws rebuilt from their raw bits.

No custom kernel runs under XLA, so :mod:`tf_sparsify.ops` then uses the pure-TF reference.
TensorFlow's stateless random ops give other numbers under XLA for the same seed: XLA derives
the Philox key from the seed differently (unless ``alg="philox"`` is passed, which scrambles it
in TF ops as the CPU and GPU kernels do) and turns the Philox bits into uniforms and normals
differently. The draws here take the raw bits with ``alg="philox"`` (identical with and
without XLA) and convert them as TensorFlow's kernels do (``tensorflow/core/lib/random/
random_distributions.h``), so a compressor's random choices do not depend on ``jit_compile``;
outside XLA they are TensorFlow's own ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import tensorflow as tf
from tensorflow.python.ops import control_flow_util

#: a static shape
Shape = Sequence[int] | tf.TensorShape
#: Box-Muller's lower bound on its first uniform (TensorFlow's ``BoxMullerFloat/Double``)
_BOX_MULLER_EPSILON = 1.0e-7


def in_xla_context() -> bool:
    """Whether ops are being traced for XLA compilation: inside ``tf.function(
    jit_compile=True)`` or the train step of a Keras model compiled with ``jit_compile=True``
    (also in functions, loops and branches nested in them)."""
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def fold_in(key: tf.Tensor, data: tf.Tensor) -> tf.Tensor:
    """``tf.random.experimental.stateless_fold_in(key, data, alg="philox")`` for an int64
    ``key`` of shape [2] and an int64 scalar ``data``, the same under XLA. Outside XLA it is
    one kernel (the seed scrambled into a Philox key and counter, then one draw), where
    TensorFlow's function scrambles the seed in about twenty small ops for XLA's sake (milliseconds
    per call when eager, and as many ops to trace)."""
    if in_xla_context():
        return tf.random.experimental.stateless_fold_in(key, data, alg="philox")
    drawn = tf.raw_ops.StatelessRandomUniformFullInt(shape=[], seed=key, dtype=tf.int64)
    return tf.stack([drawn, data])


def stateless_uniform(shape: Shape, seed: tf.Tensor) -> tf.Tensor:
    """``tf.random.stateless_uniform(shape, seed)`` (float32 in [0, 1)), the same under XLA."""
    if not in_xla_context():
        return tf.random.stateless_uniform(shape, seed=seed)
    return tf.reshape(_unit_float32(_bits(_size(shape), seed)), shape)


def stateless_uniform_int(shape: Shape, seed: tf.Tensor, maxval: int) -> tf.Tensor:
    """``tf.random.stateless_uniform(shape, seed, minval=0, maxval=maxval, dtype=tf.int32)``,
    the same under XLA (TensorFlow's kernel takes each 32-bit draw modulo ``maxval``)."""
    if not in_xla_context():
        return tf.random.stateless_uniform(
            shape, seed=seed, minval=0, maxval=maxval, dtype=tf.int32
        )
    draws = _bits(_size(shape), seed) % tf.constant(maxval, tf.uint32)
    return tf.reshape(tf.cast(draws, tf.int32), shape)


def stateless_normal(shape: Shape, seed: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    """``tf.random.stateless_normal(shape, seed, dtype=dtype)`` (a float dtype); under XLA the
    same Box-Muller pairs, within two units in the last place (the C library's ``logf`` and
    ``sincosf`` that TensorFlow's kernels call are not always correctly rounded)."""
    dtype = tf.as_dtype(dtype)
    if not in_xla_context():
        return tf.random.stateless_normal(shape, seed=seed, dtype=dtype)
    n = _size(shape)
    if dtype == tf.float64:
        bits = tf.reshape(_bits(4 * ((n + 1) // 2), seed), [-1, 4])
        pairs = _box_muller(
            _unit_float64(bits[:, 0], bits[:, 1]), _unit_float64(bits[:, 2], bits[:, 3])
        )
    else:  # float16 and bfloat16 round TensorFlow's float32 draws
        bits = tf.reshape(_bits(n + n % 2, seed), [-1, 2])
        pairs = _box_muller(_unit_float32(bits[:, 0]), _unit_float32(bits[:, 1]))
    return tf.cast(tf.reshape(tf.reshape(pairs, [-1])[:n], shape), dtype)


def _size(shape: Shape) -> int:
    return math.prod(tf.TensorShape(shape).as_list())


def _bits(n: int, seed: tf.Tensor) -> tf.Tensor:
    """The first ``n`` 32-bit Philox draws for ``seed`` (the same with and without XLA)."""
    return tf.random.stateless_uniform(
        [n], seed=seed, minval=None, maxval=None, dtype=tf.uint32, alg="philox"
    )


def _unit_float32(bits: tf.Tensor) -> tf.Tensor:
    """TensorFlow's ``Uint32ToFloat``: the low 23 bits as the mantissa of a float in [1, 2),
    minus 1."""
    mantissa = tf.bitwise.bitwise_and(bits, tf.constant(0x7FFFFF, tf.uint32))
    one_to_two = tf.bitwise.bitwise_or(mantissa, tf.constant(0x3F800000, tf.uint32))
    return tf.bitcast(one_to_two, tf.float32) - 1.0


def _unit_float64(high: tf.Tensor, low: tf.Tensor) -> tf.Tensor:
    """TensorFlow's ``Uint64ToDouble``: 20 bits of ``high`` and all of ``low`` as the mantissa
    of a double in [1, 2), minus 1."""
    high = tf.cast(tf.bitwise.bitwise_and(high, tf.constant(0xFFFFF, tf.uint32)), tf.uint64)
    mantissa = tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(high, tf.constant(32, tf.uint64)), tf.cast(low, tf.uint64)
    )
    one_to_two = tf.bitwise.bitwise_or(mantissa, tf.constant(1023 << 52, tf.uint64))
    return tf.bitcast(one_to_two, tf.float64) - 1.0


def _box_muller(u1: tf.Tensor, u2: tf.Tensor) -> tf.Tensor:
    """TensorFlow's ``BoxMullerFloat/Double``: ``[pairs, 2]`` of ``r * sin(t), r * cos(t)``,
    ``r = sqrt(-2 log(max(u1, 1e-7)))``, ``t`` the double ``2 pi u2`` in ``u1``'s dtype."""
    dtype = u1.dtype
    u1 = tf.maximum(u1, tf.constant(_BOX_MULLER_EPSILON, dtype))
    angle = tf.cast(tf.cast(u2, tf.float64) * (2.0 * math.pi), dtype)
    radius = tf.sqrt(-2.0 * _rounded(tf.math.log, u1))
    return tf.stack([_rounded(tf.sin, angle) * radius, _rounded(tf.cos, angle) * radius], 1)


def _rounded(function, x: tf.Tensor) -> tf.Tensor:
    """``function(x)`` computed in float64 and rounded to ``x``'s dtype: for float32, the
    correctly rounded value that C's ``logf``/``sincosf`` give in nearly all cases."""
    return tf.cast(function(tf.cast(x, tf.float64)), x.dtype)
