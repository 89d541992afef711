"""``model.fit``, ``evaluate`` and ``predict`` under ``MultiWorkerMirroredStrategy`` on Keras 3.

Keras 3's TF trainer fails there in two places (keras-team/keras#20585): it builds the model
from the first batch by reducing a nest of per-replica tensors across workers, which
``MultiWorkerMirroredStrategy.reduce`` does not take, and it reduces each step's scalar logs
with ``axis=0``, which scalars do not have. The repair, for models it applies to:

* the model is built from this worker's own first batch (only its shapes matter);
* scalar logs are averaged over all replicas (``axis=None``), other logs as Keras does;
* each ``keras.callbacks.BackupAndRestore`` writes to and restores from its own subfolder
  ``worker_<index>`` of its ``backup_dir``, so every worker keeps its own error-feedback
  residuals (the optimizer saves each replica's residual, see
  :mod:`tf_sparsify.replica_values`).

It applies to every model compiled with a :class:`~tf_sparsify.SparsifiedOptimizer` (anywhere
in its optimizer chain), and to every model after :func:`enable_multi_worker_fit`. Models it
does not apply to run Keras' own code, unchanged. Outside multi-worker strategies it changes
nothing. Everything here reads Keras' private API through :mod:`tf_sparsify.keras.keras_private`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from tf_sparsify.keras import keras_private

#: the model whose ``fit``/``evaluate``/``predict`` call is running, when the repair applies
_repaired_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tf_sparsify_multi_worker_fit", default=False
)
_state: dict[str, Any] = {"all_models": False}


def enable_multi_worker_fit() -> None:
    """Repair ``fit``/``evaluate``/``predict`` under ``MultiWorkerMirroredStrategy`` for every
    Keras model in this process, plain optimizers included (an explicit opt-in: models compiled
    with a :class:`~tf_sparsify.SparsifiedOptimizer` get the repair without it)."""
    _state["all_models"] = True
    install()


@functools.cache
def install() -> None:
    """Wrap Keras' TF trainer once per process; the wrappers call Keras' own code for every
    model the repair does not apply to."""
    keras_private.wrap_trainer(_repairing, _build_from_local_batch, _reduce_scalars_over_workers)


def applies_to(model) -> bool:
    """Whether the repair applies to ``model`` (opted in, or compiled with our optimizer)."""
    from tf_sparsify.keras.optimizer import find_sparsified

    return _state["all_models"] or find_sparsified(getattr(model, "optimizer", None)) is not None


def is_multi_worker(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether ``strategy`` spans more than this process (replicas on other workers)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)


def worker_index(strategy: tf.distribute.Strategy) -> int:
    """This worker's index in a multi-worker strategy's cluster."""
    return int(strategy.cluster_resolver.task_id)


def _repairing(method: Callable, name: str) -> Callable:
    """``method`` with the repair switched on for the duration of the call, when it applies."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        strategy = self.distribute_strategy
        if not (applies_to(self) and is_multi_worker(strategy)):
            return method(self, *args, **kwargs)
        if name == "fit":
            _warn_if_shuffles_may_differ(args, kwargs)
        folders = _give_backups_own_folders(kwargs.get("callbacks"), worker_index(strategy))
        token = _repaired_call.set(True)
        try:
            result = method(self, *args, **kwargs)
        finally:
            _repaired_call.reset(token)
        for folder in folders:  # Keras removed this worker's backup; the last one out tidies
            if not os.path.exists(folder) and os.path.isdir(os.path.dirname(folder)):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(folder))
        return result

    return wrapper


def _warn_if_shuffles_may_differ(args: tuple, kwargs: dict) -> None:
    """Arrays shuffled by ``fit`` are sharded after each worker shuffles them: without a global
    seed the workers' orders differ and an epoch sees some rows twice and others never."""
    x = kwargs.get("x", args[0] if args else None)
    shuffled = kwargs.get("shuffle", True) and not isinstance(x, tf.data.Dataset)
    if x is not None and shuffled and tf.compat.v1.get_seed(None)[0] is None:
        warnings.warn(
            "model.fit shuffles its arrays on every worker before sharding them: seed every worker "
            "alike (keras.utils.set_random_seed) or pass shuffle=False, else the workers' "
            "shards overlap.",
            stacklevel=3,
        )


def _give_backups_own_folders(callbacks, index: int) -> list[str]:
    """Each ``BackupAndRestore`` writes to ``<backup_dir>/worker_<index>``: every worker saves
    and restores its own state, and no two processes write one file. Returns the folders."""
    folders = []
    for callback in getattr(callbacks, "callbacks", callbacks or ()):
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            folder = f"worker_{index}"
            if os.path.basename(os.path.normpath(callback.backup_dir)) != folder:
                keras_private.redirect_backup(callback, os.path.join(callback.backup_dir, folder))
            folders.append(callback.backup_dir)
    return folders


def _build_from_local_batch(original: Callable) -> Callable:
    """Keras' symbolic build, from this worker's part of the first batch when repaired."""

    @functools.wraps(original)
    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = keras_private.model_strategy(self)
        if not (_repaired_call.get() and strategy is not None and iterator is not None):
            return original(self, iterator=iterator, data_batch=data_batch)
        for _, _, batches in iterator:
            batch = next(batches)
            data_batch = tf.nest.map_structure(
                lambda t: strategy.experimental_local_results(t)[0], batch
            )
            break
        with strategy.scope():
            keras_private.symbolic_build(self, data_batch)

    return maybe_symbolic_build


def _reduce_scalars_over_workers(original: Callable) -> Callable:
    """Keras' ``reduce_per_replica``; when repaired, scalars of a step's logs are averaged
    over every replica of every worker (Keras asks for ``axis=0``, which a scalar lacks)."""

    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if not (_repaired_call.get() and reduction in ("auto", "mean")):
            return original(values, strategy, reduction)

        def reduce(value):
            if strategy.experimental_local_results(value)[0].shape.rank == 0:
                return strategy.reduce("MEAN", value, axis=None)
            return original(value, strategy, reduction)

        return tf.nest.map_structure(reduce, values)

    return reduce_per_replica
