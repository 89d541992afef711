"""Plain SGD applied in place from sparse updates: a TopK step never builds the dense update.

When the inner optimizer is a plain ``keras.optimizers.SGD`` (no momentum, weight decay,
clipping, EMA, loss scale factor or accumulation), the update of a TopK-compressed variable is
zero but at the gathered entries, and ``var -= learning_rate * update`` is applied to those
entries only (:func:`tf_sparsify.ops.sparse_sgd_apply`) instead of zero-filling a dense update,
scaling it and subtracting it from every entry. The result equals the dense path bit for bit
where replicas sent different indices, and within a rounding where several sent the same one.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.compressors.rounds import SparseUpdate
from tf_sparsify.keras.inner_options import INNER_OPTIONS

#: inner options under which the update is no longer ``var -= learning_rate * update`` (the
#: EMA's own settings matter only with ``use_ema``)
_DENSE_OPTIONS = ("momentum",) + tuple(
    option for option in INNER_OPTIONS if option not in ("ema_momentum", "ema_overwrite_frequency")
)


def applies_in_place(optimizer: keras.optimizers.Optimizer, variables: Sequence) -> bool:
    """Whether ``optimizer``'s step on ``variables`` is plain SGD that the compiled CPU kernel
    reproduces (outside ``tf.distribute`` strategies, whose variables it cannot update, on
    machines without a GPU, and outside XLA, which runs no custom kernel and fuses the dense
    update into one pass anyway)."""
    if type(optimizer) is not keras.optimizers.SGD:
        return False
    if any(getattr(optimizer, option) for option in _DENSE_OPTIONS):
        return False
    if tf.distribute.has_strategy() or tf.config.list_logical_devices("GPU"):
        return False
    if not ops.is_compiled() or ops.in_xla_context():
        return False
    return all(
        v.constraint is None and not getattr(v, "overwrite_with_gradient", False) for v in variables
    )


def apply(
    optimizer: keras.optimizers.SGD,
    pairs: Sequence[tuple[SparseUpdate, keras.Variable]],
    count_step: bool,
) -> None:
    """Apply each sparse update to its variable at ``optimizer``'s current learning rate (read
    before its step counter moves); ``count_step``: advance that counter here (when the
    optimizer applies no dense update this step)."""
    learning_rate = tf.convert_to_tensor(optimizer.learning_rate)
    packed: dict[int, list[tuple[SparseUpdate, keras.Variable]]] = {}
    for update, variable in pairs:
        if update.columns is None:
            ops.sparse_sgd_apply(
                variable, update.values, update.indices, update.scale, learning_rate
            )
        else:  # a packed bucket's units share their gathered entries: one op for them all
            packed.setdefault(id(update.values), []).append((update, variable))
    for group in packed.values():
        group.sort(key=lambda pair: pair[0].columns[0])
        first = group[0][0]
        ops.sparse_sgd_apply_packed(
            [variable for _, variable in group],
            first.values,
            first.indices,
            [update.columns[1] for update, _ in group],
            first.scale,
            learning_rate,
        )
    if count_step:
        optimizer.iterations.assign_add(1)
