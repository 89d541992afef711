"""``keras.callbacks.BackupAndRestore`` for models compiled with a SparsifiedOptimizer.

Every worker keeps its own error-feedback rows, so each writes its own backups, and a job
resumes only from a backup that every worker of the job that wrote it completed:

* a backup is a folder ``<backup_dir>/worker_<i>/step_<n>`` (``n``: the optimizer's
  iterations) holding Keras' ``latest.weights.h5`` and ``training_metadata.json`` (epoch,
  batch, step, the job's workers and replicas). It is written under a temporary name and
  renamed when complete, so a worker killed while writing leaves no half backup;
* each worker keeps its last two backups. A worker can write the backup of step ``n`` only
  after every worker has taken the steps before it, so each has written the backup before
  ``n``: the newest backup every worker holds always exists;
* on restore, every worker takes the newest step that every worker of the saved job holds
  (and under ``MultiWorkerMirroredStrategy`` the workers check they chose the same one). A job
  of the same size restores each worker's own backup; a job of another size (workers or
  replicas, one process included) restores worker 0's weights and conserves each error-memory
  total over its own replicas (summed, split evenly), with one warning;
* when training ends, each worker removes its backups (``delete_checkpoint``).

``backup_dir`` must be a folder every worker sees (as for Keras' own callback).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import warnings

import h5py
import keras
import numpy as np
import tensorflow as tf

from tf_sparsify.core import replica_values
from tf_sparsify.keras import keras_private, wrapped

WEIGHTS = "latest.weights.h5"
METADATA = "training_metadata.json"
#: backups each worker keeps (the newest every worker holds is among them)
KEEP = 2
_STEP = re.compile(r"step_(\d+)")
_WORKER = re.compile(r"worker_(\d+)")


@dataclasses.dataclass(frozen=True)
class Job:
    """Who this process is in its job."""

    worker: int
    workers: int
    replicas: int
    strategy: tf.distribute.Strategy

    @classmethod
    def of(cls, strategy: tf.distribute.Strategy) -> Job:
        if not replica_values.is_multi_worker(strategy):
            return cls(0, 1, strategy.num_replicas_in_sync, strategy)
        local = len(strategy.extended.worker_devices)
        first = min(replica_values.local_replica_ids(strategy))
        replicas = strategy.num_replicas_in_sync
        return cls(first // local, replicas // local, replicas, strategy)


def take_over(callbacks, model) -> None:
    """Every ``BackupAndRestore`` among ``callbacks`` writes and restores as described above."""
    job = Job.of(model.distribute_strategy)
    for callback in getattr(callbacks, "callbacks", callbacks or ()):
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            keras_private.take_over_backup(
                callback,
                save=lambda c: _save(c, model, job),
                load=lambda c: _load(c, model, job),
                finish=lambda c: _finish(c, job),
            )


def _folder(callback, worker: int) -> str:
    return os.path.join(callback.backup_dir, f"worker_{worker}")


def _save(callback, model, job: Job) -> None:
    step = int(model.optimizer.iterations.numpy())
    own = _folder(callback, job.worker)
    final = os.path.join(own, f"step_{step:012d}")
    partial = os.path.join(own, f".partial_step_{step:012d}")
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    model.save_weights(os.path.join(partial, WEIGHTS))
    epoch, batch = keras_private.backup_progress(callback)
    metadata = {
        "epoch": epoch,
        "batch": batch,
        "step": step,
        "workers": job.workers,
        "replicas": job.replicas,
    }
    with open(os.path.join(partial, METADATA), "w") as f:
        json.dump(metadata, f)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    for old in sorted(_complete(own))[:-KEEP]:
        shutil.rmtree(os.path.join(own, f"step_{old:012d}"), ignore_errors=True)


def _complete(folder: str) -> dict[int, dict]:
    """The complete backups in a worker's folder: step -> metadata."""
    found = {}
    for name in _listed(folder):
        match = _STEP.fullmatch(name)
        if match:
            with contextlib.suppress(FileNotFoundError):  # pruned meanwhile
                with open(os.path.join(folder, name, METADATA)) as f:
                    found[int(match.group(1))] = json.load(f)
    return found


def _workers(root: str) -> dict[int, str]:
    """The worker folders in ``root``: worker index -> folder."""
    matches = map(_WORKER.fullmatch, _listed(root))
    return {int(m.group(1)): os.path.join(root, m.group(0)) for m in matches if m}


def _listed(folder: str) -> list[str]:
    """The names in ``folder``; none where it does not exist (or no longer does)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _held(callback) -> dict[int, dict[int, dict]]:
    """Every worker folder's complete backups: worker -> step -> metadata."""
    return {w: _complete(folder) for w, folder in _workers(callback.backup_dir).items()}


def _restore_point(held: dict[int, dict[int, dict]]) -> tuple[int, dict] | None:
    """The newest step that every worker of the job that saved it holds, and its metadata."""
    points = [
        (step, meta)
        for step, meta in held.get(0, {}).items()
        if all(step in held.get(w, {}) for w in range(meta["workers"]))
    ]
    return max(points, key=lambda p: p[0]) if points else None


def _load(callback, model, job: Job) -> None:
    held = _held(callback)
    point = _restore_point(held)
    _check_same_choice(job, -1 if point is None else point[0])
    if point is None:
        if any(held.values()):
            warnings.warn(
                f"BackupAndRestore: {callback.backup_dir} holds no backup that every worker "
                "of its job completed; training starts from the beginning.",
                stacklevel=2,
            )
        return
    step, meta = point
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    same_job = (meta["workers"], meta["replicas"]) == (job.workers, job.replicas)
    source = job.worker if same_job else 0
    path = os.path.join(_folder(callback, source), f"step_{step:012d}", WEIGHTS)
    with _quiet_row_warnings():
        model.load_weights(path)
    if not same_job and _conserve_rows(callback, model, step, meta):
        warnings.warn(
            f"BackupAndRestore: the backup was written by a job of {meta['workers']} "
            f"worker(s) and {meta['replicas']} replica(s); this job has other ones: each "
            "error-memory total is conserved (summed, then split evenly), not each replica's "
            "value.",
            stacklevel=2,
        )
    keras_private.resume_at_epoch(model, callback, meta["epoch"])


def _check_same_choice(job: Job, step: int) -> None:
    """Under ``MultiWorkerMirroredStrategy``: ValueError unless every worker chose ``step``
    (a folder some worker does not see, say)."""
    if job.workers == 1:
        return
    local = len(job.strategy.extended.worker_devices)
    chosen = replica_values.gather_rows(job.strategy, np.full([local], step, np.int64))
    if len(set(chosen.tolist())) > 1:
        raise ValueError(
            "BackupAndRestore: the workers found different backups to resume from (steps "
            f"{sorted(set(chosen.tolist()))}; -1: none): backup_dir must be a folder every "
            "worker sees."
        )


def _conserve_rows(callback, model, step: int, meta: dict) -> bool:
    """Each error-memory total of the saved job, split evenly over this job's replicas;
    whether there was any."""
    optimizer = wrapped.find_sparsified(model.optimizer)
    if optimizer is None:  # a plain Keras optimizer (enable_multi_worker_fit): no error memory
        return False
    depth = wrapped.depth(model.optimizer, optimizer)
    checkpoint = optimizer.exchange_checkpoint
    keys = checkpoint.per_replica_keys()
    index = {i: keys[id(v)] for i, v in enumerate(optimizer.variables) if id(v) in keys}
    group = "/".join(["optimizer"] + ["inner_optimizer"] * depth + ["vars"])
    saved = []
    for worker in range(meta["workers"]):
        path = os.path.join(_folder(callback, worker), f"step_{step:012d}", WEIGHTS)
        with h5py.File(path, "r") as f:
            saved.append({key: f[group][str(i)][()] for i, key in index.items()})
    checkpoint.restore_rows({k: np.concatenate([s[k] for s in saved]) for k in index.values()})
    return bool(index)


@contextlib.contextmanager
def _quiet_row_warnings():
    """Loading a backup warns that a Keras file holds its writer's error memory, and into a
    job of another size per variable: here each worker reads its own, or one warning about
    the conserved totals replaces them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Optimizer variable .* was saved for")
        warnings.filterwarnings("ignore", message=r"A Keras file holds the error memory")
        yield


def _finish(callback, job: Job) -> None:
    """At the end of training: this worker's backups go (and, for worker 0, those of workers
    a larger job had); the last one out removes ``backup_dir``."""
    if not callback.delete_checkpoint:
        return
    shutil.rmtree(_folder(callback, job.worker), ignore_errors=True)
    if job.worker == 0:
        for worker, folder in _workers(callback.backup_dir).items():
            if worker >= job.workers:
                shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rmdir(callback.backup_dir)
