"""A new compressor is one class, a new transport is a collective and the transport that makes
it: all written here, in this one file, and used by the library's front ends with no other
change."""

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


class GatherOnlyTransport(tfs.Transport):
    """The transport a front end holds: each step's collective is a GatherOnly."""

    def collective(self, pipeline, units, present=None) -> Collective:
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
        lambda: tfs.SparsifiedOptimizer(
            keras.optimizers.SGD(0.05), tfs.Identity(), transport=GatherOnlyTransport()
        ),
        lambda: keras.optimizers.SGD(0.05),
    ):
        with mirrored2.scope():
            model = _model()
            model.compile(make(), "mse")
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        weights.append(model.get_weights())
    for ours, keras_own in zip(*weights, strict=True):
        np.testing.assert_allclose(ours, keras_own, rtol=1e-6, atol=1e-7)


def _train_in_custom_loop(strategy, exchange: tfs.GradientExchange | None) -> list:
    """Four steps of a custom loop under ``strategy``: the Keras wrapper applies the
    gradients, or (with ``exchange``) the exchange's updates go to a plain SGD."""
    x, y = _data()
    with strategy.scope():
        model = _model()
        model.build((None, 6))
        variables = model.trainable_variables
        if exchange is None:
            optimizer = tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05), tfs.TopK(ratio=0.5))
        else:
            optimizer = tfs.keras.skip_gradient_all_reduce(keras.optimizers.SGD(0.05))
            exchange.build(variables)
        optimizer.build(variables)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(xb) - yb), axis=1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
        grads = tape.gradient(loss, variables)
        if exchange is not None:
            grads = exchange.updates(grads, variables)
        optimizer.apply(grads, variables)

    step = tf.function(lambda xb, yb: strategy.run(replica_step, (xb, yb)))
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    for xb, yb in strategy.experimental_distribute_dataset(batches):
        step(xb, yb)
    return model.get_weights()


def test_the_custom_loop_exchange_runs_under_tf_distribute(mirrored2):
    """A custom loop's GradientExchange under MirroredStrategy (the default transport): TopK
    50% with error feedback equals the Keras wrapper under the same strategy."""
    with mirrored2.scope():
        exchange = tfs.GradientExchange(tfs.TopK(ratio=0.5))
    ours = _train_in_custom_loop(mirrored2, exchange)
    keras_front = _train_in_custom_loop(mirrored2, None)
    assert int(exchange.step.numpy()) == 4
    for a, b in zip(ours, keras_front, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    residuals = [r for r in exchange.residuals if r is not None and len(r.shape) == 2]
    assert residuals and all(
        len({float(np.abs(v.numpy()).sum()) for v in r.values}) == 2 for r in residuals
    )  # each replica keeps its own residual
