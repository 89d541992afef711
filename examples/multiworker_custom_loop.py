"""Compressed training with MultiWorkerMirroredStrategy: local worker processes, one CPU each.

    python examples/multiworker_custom_loop.py                  # 2 workers, all configurations
    python examples/multiworker_custom_loop.py --workers 3 --configs topk,qsgd --steps 20

The launcher starts the workers as processes on localhost (free ports, a ``TF_CONFIG`` each, see
:func:`tf_sparsify.distribute.run_local_workers`; a failed or stuck worker gets everyone killed),
then checks that all workers end with identical weights and prints a table.

Each worker trains a small Keras MLP on its own shard of scikit-learn's bundled breast-cancer
data (rows ``index::P``, standardized) for every configuration: TopK with error feedback, QSGD
(int8 levels on the wire), TernGrad (packed uint8 codes) and TopK whose contributions are
applied two steps late (``ServerOptimizer`` with ``DelayedGradients(2)``). Gradients travel as
compressed payloads through tf.distribute's all-gather, the same path as under
``MirroredStrategy``. The loop is a custom one (``strategy.run`` + ``apply_gradients``), for
those who write their own; ``examples/multiworker_fit.py`` trains with ``model.fit``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# TensorFlow's C++ log lines off unless the user asked for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

CONFIGS = ("topk", "qsgd", "terngrad", "topk_delay2")
LEARNING_RATE = 0.1
SEED = 3


def make_data() -> tuple[np.ndarray, np.ndarray]:
    """Standardized breast-cancer features (float32) and 0/1 labels ``[n, 1]``."""
    from sklearn.datasets import load_breast_cancer

    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    return x.astype("float32"), y.astype("float32")[:, None]


def worker_batch(x, y, index: int, num_workers: int, step: int, batch: int):
    """Worker ``index``'s rows at ``step``: consecutive batches of its shard ``index::P``."""
    xs, ys = x[index::num_workers], y[index::num_workers]
    rows = np.arange(step * batch, (step + 1) * batch) % len(xs)
    return xs[rows], ys[rows]


def make_model():
    import keras

    keras.utils.set_random_seed(SEED)
    return keras.Sequential(
        [
            keras.Input((30,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )


def make_compressor(config: str):
    import tf_sparsify as tfs

    return {
        "topk": lambda: tfs.TopK(ratio=0.1),
        "qsgd": lambda: tfs.QSGD(levels=4, seed=1),
        "terngrad": lambda: tfs.TernGrad(seed=2),
        "topk_delay2": lambda: tfs.TopK(ratio=0.1),
    }[config]()


def config_delay(config: str) -> int:
    return 2 if config.endswith("_delay2") else 0


def make_optimizer(config: str):
    import keras

    import tf_sparsify as tfs
    from tf_sparsify.distribute import DelayedGradients, ServerOptimizer

    inner = keras.optimizers.SGD(LEARNING_RATE)
    if config_delay(config):
        return ServerOptimizer(
            inner, make_compressor(config), DelayedGradients(config_delay(config))
        )
    return tfs.SparsifiedOptimizer(inner, make_compressor(config))


def local_loss(model, xb, yb, num_replicas: int):
    """This worker's mean loss scaled by ``1 / num_replicas``, as Keras does under a strategy."""
    import keras
    import tensorflow as tf

    per_example = keras.losses.binary_crossentropy(yb, model(xb, training=True))
    return tf.reduce_mean(per_example) / num_replicas


def run_worker(args: argparse.Namespace) -> None:
    """One worker (its index comes from ``TF_CONFIG``): train every configuration, save weights."""
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=args.timeout)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    index = strategy.cluster_resolver.task_id
    num_workers = strategy.num_replicas_in_sync
    x, y = make_data()
    for config in args.configs.split(","):
        with strategy.scope():
            model = make_model()
            optimizer = make_optimizer(config)
            optimizer.build(model.trainable_variables)

        @tf.function
        def train_step(xb, yb, model=model, optimizer=optimizer):
            def replica_step(xb, yb):
                with tf.GradientTape() as tape:
                    loss = local_loss(model, xb, yb, num_workers)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))

            strategy.run(replica_step, (xb, yb))

        for step in range(args.steps):
            xb, yb = worker_batch(x, y, index, num_workers, step, args.batch)
            train_step(tf.constant(xb), tf.constant(yb))
        path = os.path.join(args.out, f"{config}_worker{index}.npz")
        np.savez(path, *[v.numpy() for v in model.trainable_variables])
        print(f"worker {index}: {config} done, {int(optimizer.bytes_sent.numpy())} bytes sent")


def load_weights(out: str, config: str, index: int) -> list[np.ndarray]:
    with np.load(os.path.join(out, f"{config}_worker{index}.npz")) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def launch(args: argparse.Namespace) -> dict[str, list[list[np.ndarray]]]:
    """Run the workers; return, per configuration, every worker's final weights."""
    from tf_sparsify.distribute import run_local_workers

    worker_args = [
        os.path.abspath(__file__),
        "--worker",
        f"--out={args.out}",
        f"--configs={args.configs}",
        f"--steps={args.steps}",
        f"--batch={args.batch}",
        f"--timeout={args.timeout}",
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2"}
    run_local_workers(worker_args, args.workers, timeout=2 * args.timeout, env=env)
    return {
        config: [load_weights(args.out, config, i) for i in range(args.workers)]
        for config in args.configs.split(",")
    }


def full_loss(weights: list[np.ndarray]) -> float:
    """Mean binary cross-entropy on the whole dataset (numpy forward pass of the MLP)."""
    x, y = make_data()
    kernel1, bias1, kernel2, bias2 = weights
    p = 1.0 / (1.0 + np.exp(-(np.maximum(x @ kernel1 + bias1, 0.0) @ kernel2 + bias2)))
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {CONFIGS}")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16, help="rows per worker and step")
    p.add_argument("--timeout", type=int, default=120, help="seconds before giving up")
    p.add_argument("--out", default=None, help="folder for the weights (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {CONFIGS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        args.out = args.out or tmp
        results = launch(args)
    print(f"{'config':<14}{'max |w_0 - w_p|':>18}{'full-data loss':>16}")
    identical = True
    for config, per_worker in results.items():
        gap = max(
            float(np.max(np.abs(a - b)))
            for other in per_worker[1:]
            for a, b in zip(per_worker[0], other, strict=True)
        )
        identical &= gap == 0.0
        print(f"{config:<14}{gap:>18.3g}{full_loss(per_worker[0]):>16.4f}")
    print("all workers identical" if identical else "WORKERS DIFFER")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
