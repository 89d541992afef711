"""A new compressor is one class, a new transport is one class: both written here, in this one
file, and used by the library's front ends with no other change."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

import tf_sparsify as tfs
from tf_sparsify.collectives import Collective


class Int8Scaled(tfs.compressors.Codec):
    """A toy codec: each tensor as int8 levels of its largest magnitude (biased, gathered)."""

    def wire_bytes(self, num_elements: int, dtype: tf.DType = tf.float32) -> int:
        return num_elements + 4

    def _compress(self, tensor, ctx, replica_id):
        scale = tf.maximum(tf.reduce_max(tf.abs(tensor)), 1e-30)
        levels = tf.cast(tf.round(tensor / scale * 127.0), tf.int8)
        return levels, tf.reshape(tf.cast(scale, tf.float32), [1])

    def _decompress(self, payload, ctx):
        levels, scale = payload
        return tf.cast(tf.cast(levels, tf.float32) * scale[0] / 127.0, ctx.dtype)


class GatherOnly(Collective):
    """A toy transport: tf.distribute's replica context, every transfer an all-gather (sums
    are gathered, then added)."""

    def __init__(self, context: tf.distribute.ReplicaContext):
        self.context = context
        self.num_replicas = context.num_replicas_in_sync

    def replica_id(self) -> tf.Tensor:
        return tf.cast(self.context.replica_id_in_sync_group, tf.int32)

    def all_gather(self, tensors):
        return [self.context.all_gather(t[None], axis=0) for t in tensors]

    def all_reduce_sum(self, tensors):
        return [tf.reduce_sum(g, axis=0) for g in self.all_gather(tensors)]


class GatherOnlyOptimizer(tfs.SparsifiedOptimizer):
    def collective(self) -> Collective:
        return GatherOnly(tf.distribute.get_replica_context())


def _model() -> keras.Model:
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5), keras.layers.Dense(1)])


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, 6)).astype("float32")
    return x, x[:, :1] - 0.5 * x[:, 1:2]


def test_a_new_codec_trains_through_the_keras_front_end():
    x, y = _data()
    model = _model()
    optimizer = tfs.SparsifiedOptimizer(
        keras.optimizers.SGD(0.05), Int8Scaled(), error_feedback=False
    )
    model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, shuffle=False)
    assert history.history["loss"][-1] < history.history["loss"][0]
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    assert optimizer.wire_bytes_per_step == sum(n + 4 for n in sizes)
    assert int(optimizer.bytes_sent.numpy()) == 12 * optimizer.wire_bytes_per_step


def test_a_new_codec_with_error_feedback_conserves_mass():
    codec = Int8Scaled()
    g = tf.constant(np.random.default_rng(0).normal(size=(40,)), tf.float32)
    residual = tf.constant(np.random.default_rng(1).normal(size=(40,)), tf.float32)
    payload, ctx, remainder = codec.compress_with_feedback(g, residual)
    sent = codec.decompress(payload, ctx)
    np.testing.assert_allclose(sent + remainder, g + residual, rtol=1e-6, atol=1e-6)


def test_a_new_transport_carries_the_exchange(mirrored2):
    """Identity through the toy transport == Keras' own SGD under the same strategy."""
    x, y = _data()
    weights = []
    for make in (
        lambda: GatherOnlyOptimizer(keras.optimizers.SGD(0.05), tfs.Identity()),
        lambda: keras.optimizers.SGD(0.05),
    ):
        with mirrored2.scope():
            model = _model()
            model.compile(make(), "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for ours, keras_own in zip(*weights, strict=True):
        np.testing.assert_allclose(ours, keras_own, rtol=1e-6, atol=1e-7)
