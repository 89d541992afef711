"""The variables of a :class:`~tf_sparsify.SparsifiedOptimizer`: which, in what order, and how
Keras' saving and ``tf.train.Checkpoint`` store and restore them.

:attr:`~OptimizerVariables.variables` are the wrapper's own, the compression state's
(residuals, momenta, counters: per-replica where they are each replica's own), then the inner
optimizer's. Keras' saving (``.keras``, ``.weights.h5``, ``BackupAndRestore``) stores each
replica's value of a per-replica variable and restores it exactly
(:mod:`tf_sparsify.core.replica_values`); in a ``tf.train.Checkpoint`` the optimizer is one
named, validated entry holding every replica's rows (:mod:`tf_sparsify.core.checkpoint`).
"""

from __future__ import annotations

import warnings

import keras

from tf_sparsify.core import replica_values
from tf_sparsify.core.checkpoint import Entry
from tf_sparsify.core.state_kinds import StateKind
from tf_sparsify.keras import keras_private


class OptimizerVariables:
    """Mixin of :class:`~tf_sparsify.SparsifiedOptimizer` (a Keras optimizer holding its
    ``CompressionState`` as ``_state`` and the optimizer it wraps as ``inner_optimizer``)."""

    @property
    def variables(self):
        """This wrapper's own variables, the compression state's, then the inner optimizer's."""
        state = [entry.variable for entry in self._state.saved]
        return self._variables + state + self.inner_optimizer.variables

    def _make_variable(self, name: str, shape, dtype, kind: StateKind) -> keras.Variable:
        """A variable of the compression state (in :attr:`variables`; checkpointed as the
        state's one entry), held across replicas as its kind says."""
        kind = StateKind(kind)
        # Keras names tf.distribute's aggregations and synchronizations in lower case.
        aggregation = kind.aggregation.name.lower()
        sync = kind.synchronization.name.lower()
        return keras_private.untracked_variable(self, shape, dtype, name, aggregation, sync)

    def _optimizer_entries(self) -> list[Entry]:
        """This wrapper's and the inner optimizer's variables, for the checkpoint entry."""
        own = [(f"optimizer/{i}", v) for i, v in enumerate(self._variables)]
        inner = [(f"inner/{i}", v) for i, v in enumerate(self.inner_optimizer.variables)]
        return [Entry(key, v, StateKind.SHARED, v.path) for key, v in own + inner]

    def _trackable_children(self, save_type="checkpoint", **kwargs):
        """In checkpoints, the whole optimizer is one named entry (this wrapper's, the
        compression state's and the inner optimizer's variables; every replica's rows),
        checked before a restore assigns anything (:mod:`tf_sparsify.core.checkpoint`)."""
        if save_type != "checkpoint":
            return super()._trackable_children(save_type, **kwargs)
        return {"tf_sparsify_optimizer": self._state.checkpoint}

    def get_weights(self) -> list:
        """The values of :attr:`variables` (this wrapper's, then the inner optimizer's)."""
        return [v.numpy() for v in self.variables]

    def set_weights(self, weights) -> None:
        """Assign :attr:`variables` (this wrapper's and the inner optimizer's) from ``weights``."""
        if not self.built:
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has not yet been built: "
                "call `optimizer.build(trainable_variables)` first."
            )
        variables = self.variables
        weights = list(weights)
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must hold {len(variables)} arrays, one per optimizer variable; "
                f"received {len(weights)}."
            )
        for variable, weight in zip(variables, weights, strict=True):
            if tuple(variable.shape) != tuple(weight.shape):
                raise ValueError(
                    f"Optimizer variable {variable.path} has shape {tuple(variable.shape)}; "
                    f"received a weight of shape {tuple(weight.shape)}."
                )
            variable.assign(weight)

    def save_own_variables(self, store) -> None:
        """Keras' saving (``.keras``, ``.weights.h5``): per-replica variables (residuals,
        momenta) as the stack of this process's replica values, read without a collective
        (:mod:`tf_sparsify.core.replica_values`)."""
        for i, variable in enumerate(self.variables):
            store[str(i)] = replica_values.saved_value(variable)

    def load_own_variables(self, store) -> None:
        """Restore what :meth:`save_own_variables` wrote: every value is checked before any is
        assigned; each replica gets its own saved value back."""
        variables = self.variables
        if len(store.keys()) != len(variables):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}': it has "
                f"{len(variables)} variables, the saved optimizer {len(store.keys())}.",
                stacklevel=2,
            )
            return
        saved = [store[str(i)] for i in range(len(variables))]
        for variable, value in zip(variables, saved, strict=True):
            replica_values.check_restorable(variable, value, variable.path)
        for variable, value in zip(variables, saved, strict=True):
            replica_values.restore(variable, value, variable.path)
        _, world = self.transport.checkpoint_rows(1)
        if world > 1 and any(r is not None for r in self.residuals + self.momenta):
            warnings.warn(
                "A Keras file holds the error memory (residuals, momenta) of the process that "
                f"wrote it; each of the {world} ranks restoring it now continues from those, "
                "not from its own. For every rank's own, use tf.train.Checkpoint after "
                "tf_sparsify.horovod.gather_error_memory (see tf_sparsify.core.checkpoint).",
                stacklevel=2,
            )
