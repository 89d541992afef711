"""Every private Keras API tf_sparsify relies on, in one place.

Keras 3 has no public hooks for an optimizer that wraps another and exchanges gradients itself
(its own ``LossScaleOptimizer`` uses the same internals). Nothing else in tf_sparsify touches
Keras' private attributes or ``keras.src``: if a Keras upgrade moves one of them, :func:`check`
names what moved (``tests/test_keras_private.py`` runs it, so the failure is one clear message).
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.trainers import trainer as base_trainer
from keras.src.utils import tracking

#: Decorator: attributes set inside the method are not tracked as Keras dependencies.
no_automatic_dependency_tracking = tracking.no_automatic_dependency_tracking

#: ``(owner, attribute)`` pairs this module uses, for :func:`check`.
_OPTIMIZER_ATTRIBUTES = (
    "_iterations",
    "_trainable_variables",
    "_trainable_variables_indices",
    "_var_key",
    "_get_variable_index",
    "_check_variables_are_known",
    "_filter_empty_gradients",
    "_track_variable",
    "_all_reduce_sum_gradients",
    "_distribution_strategy",
)


#: ``TensorFlowTrainer`` entry points, and the methods behind them that the multi-worker ``fit``
#: repair wraps (:mod:`tf_sparsify.keras.multi_worker`).
TRAINER_ENTRY_POINTS = (
    "fit",
    "evaluate",
    "predict",
    "train_on_batch",
    "test_on_batch",
    "predict_on_batch",
)
_TRAINER_INTERNALS = ("_maybe_symbolic_build", "_symbolic_build")
#: ``BackupAndRestore`` internals: how it writes and reads a backup, and its epoch counter.
_BACKUP_ATTRIBUTES = ("_save_model", "_load_model", "_current_epoch", "_last_batch_seen")


def check() -> None:
    """RuntimeError naming every private Keras API used here that this Keras lacks."""
    probe = keras.optimizers.SGD(0.1)
    missing = [name for name in _OPTIMIZER_ATTRIBUTES if not hasattr(probe, name)]
    missing += [
        f"TensorFlowTrainer.{name}"
        for name in TRAINER_ENTRY_POINTS + _TRAINER_INTERNALS
        if not callable(getattr(tf_trainer.TensorFlowTrainer, name, None))
    ]
    if not callable(getattr(base_trainer.Trainer, "_resolve_auto_jit_compile", None)):
        missing.append("Trainer._resolve_auto_jit_compile (model.compile's jit_compile='auto')")
    if not callable(getattr(tf_trainer, "reduce_per_replica", None)):
        missing.append("keras.src.backend.tensorflow.trainer.reduce_per_replica")
    backup = keras.callbacks.BackupAndRestore("probe")
    missing += [f"BackupAndRestore.{a}" for a in _BACKUP_ATTRIBUTES if not hasattr(backup, a)]
    if not callable(no_automatic_dependency_tracking):
        missing.append("keras.src.utils.tracking.no_automatic_dependency_tracking")
    ema_probe = keras.optimizers.SGD(0.1, use_ema=True)
    ema_probe.build([keras.Variable(0.0)])
    if not hasattr(ema_probe, "_model_variables_moving_average"):
        missing.append("_model_variables_moving_average (read by keras.callbacks.SwapEMAWeights)")
    strategy = tf.distribute.get_strategy()
    epochs = tf_trainer.TFEpochIterator(strategy, x=np.zeros((2, 1), "float32"), batch_size=1)
    if not hasattr(epochs, "_distributed_dataset"):
        missing.append("TFEpochIterator._distributed_dataset (the shapes of fit's batches)")
    if missing:
        raise RuntimeError(
            f"Keras {keras.__version__} moved private APIs that tf_sparsify's optimizer wrapper "
            f"needs: {', '.join(missing)}. Update tf_sparsify/keras/keras_private.py."
        )


def iterations_variable(optimizer: keras.optimizers.Optimizer) -> keras.Variable:
    """The optimizer's own step counter (``iterations`` may divide it by accumulation steps)."""
    return optimizer._iterations


def trainable_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables the optimizer was built for, in build order."""
    return optimizer._trainable_variables


def index_variables(optimizer: keras.optimizers.Optimizer, variables: list) -> None:
    """What Keras' ``build`` records about the variables, without the EMA or accumulator
    variables its build would also make (a wrapper's inner optimizer keeps those)."""
    optimizer._trainable_variables_indices = {
        optimizer._var_key(v): i for i, v in enumerate(variables)
    }
    optimizer._trainable_variables = list(variables)


def variable_index(optimizer: keras.optimizers.Optimizer, variable) -> int:
    """Position of ``variable`` in build order."""
    return optimizer._get_variable_index(variable)


def check_variables_are_known(optimizer: keras.optimizers.Optimizer, variables: list) -> None:
    """Keras' ValueError ("Unknown variable") for variables the optimizer was not built for."""
    optimizer._check_variables_are_known(variables)


def check_gradients(optimizer: keras.optimizers.Optimizer, grads: list, variables: list) -> None:
    """Keras' "No gradients provided" ValueError for all-``None`` gradients, and its warning
    naming the variables whose gradient is ``None``."""
    optimizer._filter_empty_gradients(grads, variables)


def track_variable(optimizer: keras.optimizers.Optimizer, variable: keras.Variable) -> None:
    """Make ``variable`` one of ``optimizer.variables`` (saved and checkpointed with it)."""
    optimizer._track_variable(variable)


def replica_variable(
    optimizer: keras.optimizers.Optimizer, shape, dtype, name: str, aggregation: str
) -> keras.Variable:
    """A zero optimizer variable of which each replica writes only its own copy (sync-on-read;
    ``aggregation`` says how a cross-replica read combines the copies). Keras'
    ``add_variable`` with ``synchronization="on_read"``, which it does not let callers pass."""
    variable = untracked_variable(optimizer, shape, dtype, name, aggregation, "on_read")
    track_variable(optimizer, variable)
    return variable


def untracked_variable(
    optimizer: keras.optimizers.Optimizer,
    shape,
    dtype,
    name: str,
    aggregation: str,
    synchronization: str,
) -> keras.Variable:
    """A zero variable in the optimizer's name scope that is not one of its ``_variables``
    (the optimizer saves and checkpoints it its own way)."""
    with keras.name_scope(optimizer.name, caller=optimizer):
        return keras.Variable(
            initializer=keras.initializers.Zeros(),
            shape=shape,
            dtype=dtype,
            trainable=False,
            aggregation=aggregation,
            synchronization=synchronization,
            name=name,
        )


def disable_dense_all_reduce(optimizer: keras.optimizers.Optimizer) -> None:
    """Turn off the dense gradient all-reduce of one of Keras' TF optimizers.

    The TF backend all-reduces gradients inside ``apply`` when a replica context is active;
    the update a wrapper hands on is already the cross-replica average, so that reduction must
    not run (:func:`tf_sparsify.keras.wrapped.skip_gradient_all_reduce` does it down a chain).
    """
    optimizer._all_reduce_sum_gradients = _pass_through


def _pass_through(grads_and_vars):
    return list(grads_and_vars)


# -- the TF trainer (multi-worker ``fit``) ------------------------------------------------------
def wrap_trainer(entry_point, build_from_batch, reduce_per_replica) -> None:
    """Wrap Keras' TF trainer for every model: each method named in
    :data:`TRAINER_ENTRY_POINTS` becomes ``entry_point(method, name)``, the symbolic build
    before the first step ``build_from_batch(method)``, and the reduction of each step's
    outputs over replicas ``reduce_per_replica(function)`` (used from the step functions'
    next trace on)."""
    trainer = tf_trainer.TensorFlowTrainer
    for name in TRAINER_ENTRY_POINTS:
        setattr(trainer, name, entry_point(getattr(trainer, name), name))
    trainer._maybe_symbolic_build = build_from_batch(trainer._maybe_symbolic_build)
    tf_trainer.reduce_per_replica = reduce_per_replica(tf_trainer.reduce_per_replica)


def wrap_auto_jit_compile(wrapper) -> None:
    """How ``model.compile`` resolves ``jit_compile="auto"`` (a method of the model, called
    after ``model.optimizer`` is set) becomes ``wrapper(method)``."""
    trainer = base_trainer.Trainer
    trainer._resolve_auto_jit_compile = wrapper(trainer._resolve_auto_jit_compile)


def symbolic_build(model, data_batch) -> None:
    """Build the model, its metrics and optimizer from one batch (Keras' ``_symbolic_build``)."""
    model._symbolic_build(data_batch=data_batch)


def batch_spec(iterator) -> object:
    """The structure of ``tf.TensorSpec`` of the batches a TF ``EpochIterator`` yields."""
    return iterator._distributed_dataset.element_spec


def model_strategy(model):
    """The strategy the model was created under (``None``: none; Keras then builds lazily)."""
    return model._distribute_strategy


def take_over_backup(callback: keras.callbacks.BackupAndRestore, save, load, finish) -> None:
    """Make a ``BackupAndRestore`` callback write a backup with ``save(callback)``, restore
    one with ``load(callback)`` (at the start of ``fit``) and end with ``finish(callback)``."""
    callback._save_model = lambda: save(callback)
    callback._load_model = lambda: load(callback)
    callback.on_train_end = lambda logs=None: finish(callback)


def backup_progress(callback: keras.callbacks.BackupAndRestore) -> tuple[int, int]:
    """``(epoch, batch)`` a ``BackupAndRestore`` callback records in a backup."""
    return callback._current_epoch, callback._last_batch_seen


def resume_at_epoch(model, callback: keras.callbacks.BackupAndRestore, epoch: int) -> None:
    """Start ``fit`` at ``epoch`` (what Keras' restore sets), counted on by ``callback``."""
    model._initial_epoch = epoch
    callback._current_epoch = epoch
