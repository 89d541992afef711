"""A custom training loop under Horovod: ``DistributedGradientTape`` + ``GradientExchange``.

The exchange (TopK 1% + error feedback by default) is made once, so its residuals and RNG
step outlive the tape made every step. Each rank trains on its own shard of scikit-learn's
digits; rank 0 prints the averaged loss per epoch, the test accuracy and the bytes per step.

    horovodrun -np 2 --gloo python examples/horovod_custom_loop.py --epochs 20
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from horovod_keras_digits import COMPRESSORS, load_shard, make_model, parse_args, report  # noqa: E402

import tf_sparsify.horovod as th  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv, __doc__)
    hvd.init()
    x_tr, y_tr, x_te, y_te = load_shard(hvd.rank(), hvd.size())
    model = make_model(args.seed + hvd.rank())
    optimizer = keras.optimizers.SGD(args.lr, momentum=0.9)
    optimizer.build(model.trainable_variables)
    # Same start everywhere: rank 0's weights and optimizer state.
    th.broadcast_variables(model.variables + optimizer.variables, root_rank=0)
    exchange = th.GradientExchange(COMPRESSORS[args.compressor]())
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = th.DistributedGradientTape(tape, exchange=exchange)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    data = tf.data.Dataset.from_tensor_slices((x_tr, y_tr))
    start = time.perf_counter()
    for epoch in range(args.epochs):
        losses = [
            train_step(x, y)
            for x, y in data.shuffle(len(x_tr), seed=args.seed + epoch).batch(args.batch_size)
        ]
        mean_loss = hvd.allreduce(tf.reduce_mean(losses), op=hvd.Average, name="epoch_loss")
        th.log0(f"epoch {epoch + 1}/{args.epochs}: loss {float(mean_loss):.4f}")
    wall = time.perf_counter() - start
    logits = model.predict(x_te, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_te))
    steps = int(exchange.step.numpy())
    return report(
        args.compressor,
        accuracy,
        steps,
        int(exchange.bytes_to_horovod.numpy()),
        exchange.wire_bytes_per_step,
        4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables),
        wall,
    )


if __name__ == "__main__":
    main()
