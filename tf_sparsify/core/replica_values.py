"""Saving and restoring per-replica state variables replica by replica.

Error-feedback residuals, DGC momenta and diagnostics are sync-on-read variables: each replica
holds its own value. Keras saves a variable by reading it across replicas, which sums (or
averages) the replicas' values and, under ``MultiWorkerMirroredStrategy``, is a collective
every worker must join. Here a per-replica variable is saved as the stack ``[R, *shape]`` of
this process's ``R`` replica values, read locally (no collective: a chief-only save cannot hang)
and restored row by row, so each replica continues from exactly its own value. A variable that
is not per-replica is saved and restored as Keras does.

Restoring into a different number of replicas conserves the total: a summed variable's rows
(or one unstacked value) are summed and split evenly over the replicas, an averaged one's are
averaged; a warning says so.
"""

from __future__ import annotations

import warnings

import numpy as np
import tensorflow as tf

from tf_sparsify.core.state_kinds import StateKind


def is_multi_worker(strategy: tf.distribute.Strategy | None) -> bool:
    """Whether ``strategy`` spans more than this process (replicas on other workers)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    return strategy.num_replicas_in_sync > len(strategy.extended.worker_devices)


def local_replica_ids(strategy: tf.distribute.Strategy) -> list[int]:
    """The job-wide ids (``replica_id_in_sync_group``) of this process's replicas."""
    ids = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(context.replica_id_in_sync_group)
    )
    return [int(i) for i in strategy.experimental_local_results(ids)]


def gather_rows(strategy: tf.distribute.Strategy, rows: np.ndarray) -> np.ndarray:
    """Every replica's row of the job, from this process's ``rows`` (one per local replica, in
    :func:`local_replica_ids` order): an all-gather every process must join."""
    ids = local_replica_ids(strategy)
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(rows[ids.index(context.replica_id_in_sync_group)][None])
    )
    return strategy.gather(per_replica, axis=0).numpy()


def check_in_scope(variables) -> None:
    """ValueError when ``variables`` belong to a distribution strategy whose scope is not
    entered: per-replica state made there would be one plain variable every replica shares."""
    current = tf.distribute.get_strategy()
    for variable in variables:
        value = _distributed(variable)
        strategy = getattr(value, "distribute_strategy", None)
        if isinstance(value, tf.distribute.DistributedValues) and strategy is not current:
            raise ValueError(
                f"Variable {getattr(variable, 'path', variable.name)} was created under "
                f"{type(strategy).__name__}, but the optimizer is being built outside its "
                "scope. Need to be inside strategy.scope(): `with strategy.scope(): "
                "optimizer.build(model.trainable_variables)`."
            )


def _distributed(variable):
    """The TF variable behind a Keras variable, or ``variable`` itself."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable
    return getattr(variable, "value", variable)


def _replica_parts(variable) -> tuple | None:
    """This process's per-replica components of a sync-on-read variable, else ``None``."""
    value = _distributed(variable)
    if not isinstance(value, tf.distribute.DistributedValues):
        return None
    if value.synchronization != tf.VariableSynchronization.ON_READ:
        return None
    return tuple(value.distribute_strategy.experimental_local_results(value))


def _this_replica(variable) -> tf.Variable:
    """The TF variable holding this replica's value of ``variable`` (a per-replica variable's
    component for the current replica: TF's sync-on-read variables take no scatter or sparse
    read themselves)."""
    value = variable if isinstance(variable, tf.Variable) else _distributed(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        value = value._get_on_device_or_primary()  # TF private: this replica's component
    return value


def current_values(variables) -> list:
    """The current value of each variable (this replica's copy), ``None`` kept."""
    return [None if v is None else tf.convert_to_tensor(v) for v in variables]


def read_rows(variable, rows: tf.Tensor) -> tf.Tensor:
    """The ``rows`` of this replica's value of ``variable`` (or of a tensor), read without the
    others: a variable written by :func:`write_rows` would copy its whole value on every dense
    read (TF's copy-on-read mode after a scatter)."""
    if isinstance(variable, tf.Tensor):
        return tf.gather(variable, rows)
    return _this_replica(variable).sparse_read(rows)


def write_rows(variable, rows: tf.IndexedSlices) -> None:
    """Write ``rows`` into this replica's value of ``variable``; its other rows stay as they
    are."""
    _this_replica(variable).scatter_update(rows)


def is_per_replica(variable) -> bool:
    """Whether each replica this process holds keeps its own value of ``variable``."""
    return _replica_parts(variable) is not None


def replica_count(variable) -> int:
    """How many values of ``variable`` this process holds (one unless per-replica)."""
    parts = _replica_parts(variable)
    return 1 if parts is None else len(parts)


def saved_value(variable) -> np.ndarray:
    """What to save for ``variable``: its replicas' values stacked, or its value."""
    parts = _replica_parts(variable)
    if parts is None:
        return variable.numpy()
    return np.stack([part.numpy() for part in parts])


def check_restorable(variable, saved: np.ndarray, name: str) -> None:
    """ValueError naming ``name`` when ``saved`` fits ``variable`` neither as one value nor as
    a stack of per-replica values."""
    shape = tuple(variable.shape)
    saved_shape = tuple(np.shape(saved))
    stacked = len(saved_shape) == len(shape) + 1 and saved_shape[1:] == shape
    if saved_shape != shape and not stacked:
        raise ValueError(
            f"Cannot restore optimizer variable {name} of shape {shape} from a saved value of "
            f"shape {saved_shape}: the checkpoint was written for other variables."
        )


def restore(variable, saved: np.ndarray, name: str) -> None:
    """Assign ``saved`` (from :func:`saved_value`, checked by :func:`check_restorable`); saved
    for another number of replicas, each value's total is conserved
    (:meth:`~tf_sparsify.core.state_kinds.StateKind.resized`)."""
    saved = np.asarray(saved)
    parts = _replica_parts(variable)
    stacked = saved.ndim == len(variable.shape) + 1
    if parts is None:
        if stacked:
            _warn_conserved(name, len(saved), 1)
            saved = _kind(variable).resized(saved, 1)[0]
        variable.assign(saved)
        return
    if stacked and len(saved) == len(parts):
        rows = saved
    else:
        _warn_conserved(name, len(saved) if stacked else 1, len(parts))
        rows = _kind(variable).resized(saved if stacked else saved[None], len(parts))
    for part, row in zip(parts, rows, strict=True):
        part.assign(row.astype(part.dtype.as_numpy_dtype))


def _kind(variable) -> StateKind:
    """The per-replica kind of a sync-on-read variable, by its aggregation."""
    return StateKind.of_aggregation(_distributed(variable).aggregation)


def _warn_conserved(name: str, saved: int, now: int) -> None:
    warnings.warn(
        f"Optimizer variable {name} was saved for {saved} replica(s) and is restored into "
        f"{now}: its total is conserved (summed, then split evenly), not each replica's value.",
        stacklevel=3,
    )
