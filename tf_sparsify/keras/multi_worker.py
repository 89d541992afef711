"""``model.fit``, ``evaluate`` and ``predict`` under ``MultiWorkerMirroredStrategy`` on Keras 3.

Keras 3's TF trainer fails there in two places (keras-team/keras#20585): it builds the model
from the first batch by reducing a nest of per-replica tensors across workers, which
``MultiWorkerMirroredStrategy.reduce`` does not take, and it reduces each step's scalar logs
with ``axis=0``, which scalars do not have. The repair, for models it applies to:

* the model is built from this worker's own first batch (only its shapes matter);
* scalar logs are averaged over all replicas (``axis=None``), other logs as Keras does;
* each ``keras.callbacks.BackupAndRestore`` keeps every worker's own backups, and the
  workers resume from one step that all of them completed, also in a job of another size
  (:mod:`tf_sparsify.keras.backups`).

It applies to every model compiled with a :class:`~tf_sparsify.SparsifiedOptimizer` (anywhere
in its optimizer chain), and to every model after :func:`enable_multi_worker_fit`. Models it
does not apply to run Keras' own code, unchanged. Outside multi-worker strategies it changes
nothing but this: without a strategy, ``fit`` and ``train_on_batch`` of those models build the
optimizer before the first trace of the train step (:mod:`tf_sparsify.keras.first_trace`).
Everything here reads Keras' private API through :mod:`tf_sparsify.keras.keras_private`.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from tf_sparsify.core import replica_values
from tf_sparsify.keras import backups, first_trace, in_flight, keras_private
from tf_sparsify.keras.wrapped import find_sparsified

#: the model whose ``fit``/``evaluate``/``predict`` call is running, when the repair applies
_repaired_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tf_sparsify_multi_worker_fit", default=False
)
#: a ``fit`` or ``train_on_batch`` call of a model the wrapper applies to is running
_training_call: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tf_sparsify_training_call", default=False
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
    return _state["all_models"] or find_sparsified(getattr(model, "optimizer", None)) is not None


def _repairing(method: Callable, name: str) -> Callable:
    """``method`` with the repair switched on for the duration of the call, when it applies;
    ``BackupAndRestore`` callbacks of the models it applies to keep every worker's own
    backups (:mod:`tf_sparsify.keras.backups`), under any strategy; ``fit`` ends by applying
    the update still in flight (:mod:`tf_sparsify.keras.in_flight`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not applies_to(self):
            return method(self, *args, **kwargs)
        backups.take_over(kwargs.get("callbacks"), self)
        repaired = replica_values.is_multi_worker(self.distribute_strategy)
        if repaired and name == "fit":
            _warn_if_shuffles_may_differ(args, kwargs)
        repaired_token = _repaired_call.set(repaired)
        training_token = _training_call.set(name in ("fit", "train_on_batch"))
        try:
            result = method(self, *args, **kwargs)
        finally:
            _training_call.reset(training_token)
            _repaired_call.reset(repaired_token)
        if name == "fit":
            in_flight.apply_at_fit_end(self)
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


def _build_from_local_batch(original: Callable) -> Callable:
    """Keras' symbolic build, from this worker's part of the first batch when repaired;
    without a strategy, before the first trace of a training call's step."""

    @functools.wraps(original)
    def maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = keras_private.model_strategy(self)
        if _training_call.get():
            first_trace.build_before_first_trace(self, iterator, data_batch)
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
