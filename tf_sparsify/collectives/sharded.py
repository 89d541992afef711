"""The hierarchical exchange's layout: each rank works on its shard of its node's sum.

With ``L`` ranks per node, the state core plans for this rank's :class:`Shard` of each
variable: ``1/L`` of its entries (rounded up), flat but with the variable's rank. A step's
gradients become this rank's shards of the node's sums (one reduce-scatter per bucket inside
the node), and the shard updates become full updates again (one all-gather per bucket), each
shard NaN unless its lane's step was finite, so ``finite`` is then the same on every rank. The
node's collective is given (``None`` with one rank per node: nothing to sum); it needs
``reduce_scatter_sum`` and ``all_gather``.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_sparsify.collectives.base import Collective
from tf_sparsify.collectives.layout import Layout
from tf_sparsify.common.finite import all_finite, mark_non_finite


@dataclasses.dataclass(frozen=True)
class Shard:
    """What the state core sees of a variable: this rank's part of its node's sum, ``1/L`` of
    the entries rounded up, flat but with the variable's rank (so ``skip_1d`` still tells
    biases from kernels)."""

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: tf.DType


def shard_of(variable, ranks_per_node: int) -> Shard:
    """This rank's shard of ``variable`` with ``ranks_per_node`` ranks per node."""
    shape = tf.TensorShape(variable.shape)
    size = -(-shape.num_elements() // ranks_per_node)
    trailing = (1,) * max(shape.rank - 1, 0)
    path = getattr(variable, "path", None) or variable.name
    return Shard(variable.name, path, (size, *trailing), tf.as_dtype(variable.dtype))


class ShardedLayout(Layout):
    """Gradients to this rank's shards of the node's sums, and shard updates back.

    Args:
        node: the node's collective (``None`` with one rank per node).
        buckets: the variable indices of each bucket, in the order they travel.
        shards: this rank's :class:`Shard` of each variable; ``shapes`` the variables' shapes.
        ranks_per_node: ``L``.
    """

    def __init__(
        self,
        node: Collective | None,
        buckets: list[list[int]],
        shards: list[Shard],
        shapes: list[tf.TensorShape],
        ranks_per_node: int,
    ):
        self._node = node
        self._buckets = buckets
        self._shards = shards
        self._shapes = shapes
        self._ranks_per_node = ranks_per_node

    def to_layout(self, grads: list) -> list:
        return _scatter(self._node, grads, self._buckets, self._shards, self._ranks_per_node)

    def from_layout(self, updates: list, finite: tf.Tensor) -> tuple[list, tf.Tensor]:
        return _gather(self._node, updates, finite, self._buckets, self._shapes)


def _scatter(
    node: Collective | None,
    grads: list,
    buckets: list[list[int]],
    shards: list[Shard],
    ranks_per_node: int,
) -> list[tf.Tensor | None]:
    """This rank's shard of its node's sum of each gradient (one reduce-scatter per bucket);
    ``None`` gradients stay ``None``."""
    out: list[tf.Tensor | None] = [None] * len(grads)
    for bucket in buckets:
        present = [i for i in bucket if grads[i] is not None]
        flat = [_padded(grads[i], ranks_per_node * shards[i].shape[0]) for i in present]
        parts = flat if node is None else node.reduce_scatter_sum(flat)
        for i, part in zip(present, parts, strict=True):
            out[i] = tf.reshape(part, shards[i].shape)
    return out


def _padded(grad, length: int) -> tf.Tensor:
    flat = tf.reshape(tf.convert_to_tensor(grad), [-1])
    return tf.pad(flat, [[0, length - flat.shape[0]]])


def _gather(
    node: Collective | None,
    updates: list,
    finite: tf.Tensor,
    buckets: list[list[int]],
    shapes: list[tf.TensorShape],
) -> tuple[list, tf.Tensor]:
    """The full updates from the node's shard updates (one all-gather per bucket), each shard
    NaN unless its lane's step was finite; ``finite`` is then the same on every rank."""
    updates_in, updates = updates, [None] * len(shapes)
    checks = []
    for bucket in buckets:
        present = [i for i in bucket if updates_in[i] is not None]
        parts = [mark_non_finite(tf.reshape(updates_in[i], [-1]), finite) for i in present]
        gathered = parts if node is None else node.all_gather(parts)
        for i, whole in zip(present, gathered, strict=True):
            checks.append(all_finite(whole))
            entries = tf.reshape(whole, [-1])[: shapes[i].num_elements()]
            updates[i] = tf.reshape(entries, shapes[i])
    return updates, tf.reduce_all(tf.stack(checks)) if checks else finite
