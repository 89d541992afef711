"""One worker of a ``MultiWorkerMirroredStrategy`` job that trains with ``model.fit``.

    python tests/multiworker_workers/fit.py --out DIR [--configs topk,identity,...] [--data numpy]
        [--strategy mwms|mirrored|none] [--backup DIR] [--kill-at EPOCH:BATCH]
        [--kill-before-backup EPOCH] [--kill-in-backup EPOCH] [--kill-worker W]
        [--chief-save] [--chief-checkpoint]

Under ``mwms`` the worker index comes from ``TF_CONFIG`` (``run_local_workers``); ``mirrored``
runs one process with a 2-replica ``MirroredStrategy`` over logical CPU devices, for
comparison, ``none`` one process without a strategy. Configurations run one after another:
``topk``, ``identity``, ``auto`` (a SparsifiedOptimizer; ``auto`` with ``AutoCompression``
deciding every 2 steps), ``plain`` (Keras' SGD), any of them with
``_dataset`` (its input a ``tf.data.Dataset`` whatever ``--data`` says), and ``enable``, which
trains nothing and calls ``enable_multi_worker_fit()`` for those after it. Per configuration it
writes
``<config>_<worker>.npz`` (weights, the optimizer's saved values and which are residuals,
evaluation, predictions, with ``--backup`` the optimizer's values right after the backup was
restored) and ``<config>_<worker>.json`` (history). ``--kill-before-backup E``
kills worker ``W`` (``--kill-worker``, default 1) at the end of epoch ``E`` before it writes
its backup, ``--kill-in-backup E`` after its weights file is written, before the backup is
complete. ``--chief-checkpoint``: the chief writes a ``tf.train.Checkpoint`` (the others a
copy elsewhere), every worker restores the chief's into a fresh model (``restored*``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sparsify as tfs  # noqa: E402
from tf_sparsify.core import replica_values  # noqa: E402

GLOBAL_BATCH = 64
ROWS = 512


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 20)).astype("float32")
    y = (np.tanh(x[:, :3].sum(1, keepdims=True)) + 0.1 * x[:, 3:4]).astype("float32")
    return x, y


def make_optimizer(config: str):
    config = config.removesuffix("_dataset")
    if config == "plain":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    compressor = {"topk": tfs.TopK(ratio=0.1), "identity": tfs.Identity(), "auto": tfs.Auto()}
    compressor = compressor[config]
    return tfs.SparsifiedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), compressor)


def make_model(strategy, config: str) -> keras.Model:
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((20,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer=make_optimizer(config), loss="mse", metrics=["mae"])
    return model


def inputs(args, x, y, config: str) -> dict:
    if args.data == "dataset" or config.endswith("_dataset"):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
        return {"x": dataset}
    return {"x": x, "y": y, "batch_size": GLOBAL_BATCH, "shuffle": False}


class KillAt(keras.callbacks.Callback):
    """SIGKILL this process after batch ``batch`` of epoch ``epoch`` (a crash mid-epoch)."""

    def __init__(self, epoch: int, batch: int):
        super().__init__()
        self.kill_epoch, self.kill_batch, self.epoch = epoch, batch, -1

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (self.kill_epoch, self.kill_batch):
            os.kill(os.getpid(), signal.SIGKILL)


class KillBeforeBackup(keras.callbacks.Callback):
    """SIGKILL this process at the end of epoch ``epoch``, before the callbacks after it."""

    def __init__(self, epoch: int):
        super().__init__()
        self.kill_epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.kill_epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_in_backup(model, epoch: int) -> None:
    """SIGKILL this process once it has written the weights file of its backup at the end of
    epoch ``epoch`` (the backup's metadata not yet)."""
    save_weights = model.save_weights
    done = {"epochs": 0}

    def saving(*args, **kwargs):
        save_weights(*args, **kwargs)
        done["epochs"] += 1
        if done["epochs"] == epoch + 1:
            os.kill(os.getpid(), signal.SIGKILL)

    model.save_weights = saving


class RecordRestored(keras.callbacks.Callback):
    """The optimizer's saved values when training begins (after a backup's restore)."""

    def on_train_begin(self, logs=None):
        self.values = [replica_values.saved_value(v) for v in self.model.optimizer.variables]


def chief_checkpoint(strategy, model, config: str, worker: int, out: str) -> list[np.ndarray]:
    """The chief writes a checkpoint, the others a copy in a temporary folder; every worker
    restores the chief's into a fresh model: its optimizer's saved values."""
    folder = out if worker == 0 else tempfile.mkdtemp()
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.write(os.path.join(folder, f"{config}_ckpt"))
    barrier = strategy.run(lambda: tf.constant(1.0))
    strategy.reduce("SUM", barrier, axis=None)  # the chief's file is complete
    fresh = make_model(strategy, config)
    with strategy.scope():
        fresh.optimizer.build(fresh.trainable_variables)
    restored = tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer)
    restored.read(os.path.join(out, f"{config}_ckpt")).assert_consumed()
    return [replica_values.saved_value(v) for v in fresh.optimizer.variables]


def run(args) -> None:
    if args.strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        worker = 0
    elif args.strategy == "none":
        strategy, worker = tf.distribute.get_strategy(), 0
    else:
        options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=120)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
        worker = strategy.cluster_resolver.task_id
    if args.enable:
        tfs.distribute.enable_multi_worker_fit()
    x, y = make_data()
    for config in args.configs.split(","):
        if config == "enable":
            tfs.distribute.enable_multi_worker_fit()
            continue
        model = make_model(strategy, config)
        callbacks, record = [], RecordRestored()
        if config.startswith("auto"):
            callbacks.append(tfs.AutoCompression(interval=2))
        killed = worker == args.kill_worker
        if args.kill_before_backup is not None and killed:
            callbacks.append(KillBeforeBackup(args.kill_before_backup))
        if args.kill_in_backup is not None and killed:
            kill_in_backup(model, args.kill_in_backup)
        if args.backup:
            callbacks.append(keras.callbacks.BackupAndRestore(os.path.join(args.backup, config)))
            callbacks.append(record)
        if args.kill_at and killed:
            callbacks.append(KillAt(*map(int, args.kill_at.split(":"))))
        try:
            history = model.fit(
                **inputs(args, x, y, config), epochs=args.epochs, verbose=0, callbacks=callbacks
            )
        except Exception as error:  # reported for the test to match
            print(f"FIT FAILED {config}: {type(error).__name__}: {str(error)[:300]}", flush=True)
            continue
        if args.chief_save and worker == 0:
            model.save(os.path.join(args.out, f"{config}_chief.keras"))
        extra = {}
        if args.chief_checkpoint:
            restored = chief_checkpoint(strategy, model, config, worker, args.out)
            extra.update({f"restored{i}": r for i, r in enumerate(restored)})
        if args.backup:
            extra.update({f"resumed{i}": r for i, r in enumerate(record.values)})
        evaluation = model.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0)
        predictions = model.predict(x[:100], batch_size=GLOBAL_BATCH, verbose=0)
        saved = [replica_values.saved_value(v) for v in model.optimizer.variables]
        residuals = [r for r in getattr(model.optimizer, "residuals", ()) if r is not None]
        extra["residual_indexes"] = np.array(
            [i for i, v in enumerate(model.optimizer.variables) if any(v is r for r in residuals)]
        )
        np.savez(
            os.path.join(args.out, f"{config}_{worker}.npz"),
            evaluation=np.asarray(evaluation),
            predictions=predictions,
            **{f"w{i}": w for i, w in enumerate(model.get_weights())},
            **{f"o{i}": s for i, s in enumerate(saved)},
            **extra,
        )
        with open(os.path.join(args.out, f"{config}_{worker}.json"), "w") as f:
            json.dump(history.history, f)
        print(f"worker {worker}: {config} done", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--configs", default="topk")
    p.add_argument("--data", choices=("numpy", "dataset"), default="numpy")
    p.add_argument("--strategy", choices=("mwms", "mirrored", "none"), default="mwms")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--backup", default=None)
    p.add_argument("--kill-at", default=None)
    p.add_argument("--kill-before-backup", type=int, default=None)
    p.add_argument("--kill-in-backup", type=int, default=None)
    p.add_argument("--kill-worker", type=int, default=1)
    p.add_argument("--chief-save", action="store_true")
    p.add_argument("--chief-checkpoint", action="store_true")
    p.add_argument("--enable", action="store_true", help="enable_multi_worker_fit() first")
    run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
