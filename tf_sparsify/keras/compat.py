"""Every private Keras API tf_sparsify relies on, in one place.

Keras 3 has no public hooks for an optimizer that wraps another and exchanges gradients itself
(its own ``LossScaleOptimizer`` uses the same internals). Nothing else in tf_sparsify touches
Keras' private attributes or ``keras.src``: if a Keras upgrade moves one of them, :func:`check`
names what moved (``tests/test_compat.py`` runs it, so the failure is one clear message).
"""

from __future__ import annotations

import keras
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


def check() -> None:
    """RuntimeError naming every private Keras API used here that this Keras lacks."""
    probe = keras.optimizers.SGD(0.1)
    missing = [name for name in _OPTIMIZER_ATTRIBUTES if not hasattr(probe, name)]
    if not callable(no_automatic_dependency_tracking):
        missing.append("keras.src.utils.tracking.no_automatic_dependency_tracking")
    ema_probe = keras.optimizers.SGD(0.1, use_ema=True)
    ema_probe.build([keras.Variable(0.0)])
    if not hasattr(ema_probe, "_model_variables_moving_average"):
        missing.append("_model_variables_moving_average (read by keras.callbacks.SwapEMAWeights)")
    if missing:
        raise RuntimeError(
            f"Keras {keras.__version__} moved private APIs that tf_sparsify's optimizer wrapper "
            f"needs: {', '.join(missing)}. Update tf_sparsify/keras/compat.py."
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
    with keras.name_scope(optimizer.name, caller=optimizer):
        variable = keras.Variable(
            initializer=keras.initializers.Zeros(),
            shape=shape,
            dtype=dtype,
            trainable=False,
            aggregation=aggregation,
            synchronization="on_read",
            name=name,
        )
    track_variable(optimizer, variable)
    return variable


def disable_dense_all_reduce(optimizer: keras.optimizers.Optimizer | None) -> None:
    """Turn off the dense gradient all-reduce of Keras' TF optimizers down a wrapper chain.

    The TF backend all-reduces gradients inside ``apply`` when a replica context is active;
    the update a wrapper hands on is already the cross-replica average, so that reduction must
    not run.
    """
    while optimizer is not None:
        optimizer._all_reduce_sum_gradients = _pass_through
        optimizer = getattr(optimizer, "inner_optimizer", None)


def _pass_through(grads_and_vars):
    return list(grads_and_vars)
