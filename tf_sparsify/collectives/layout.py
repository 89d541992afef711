"""How a step's gradients map onto the layout the state core planned, and its updates back.

The state core plans units and buffers for what its transport's ``layout`` shows it: the
variables themselves, or (the hierarchical Horovod exchange) this rank's shard of each. A
step's collective carries the matching :class:`Layout`: :meth:`~Layout.to_layout` turns the
step's gradients into the planned layout, :meth:`~Layout.from_layout` the updates back. Both
work on plain lists of tensors (``None`` where a variable has none).
"""

from __future__ import annotations

import tensorflow as tf


class Layout:
    """The identity: the state core planned the variables themselves."""

    def to_layout(self, grads: list) -> list:
        """The step's gradients in the planned layout."""
        return grads

    def from_layout(self, updates: list, finite: tf.Tensor) -> tuple[list, tf.Tensor]:
        """The updates in the variables' layout, and whether the step was finite on every
        replica."""
        return updates, finite


IDENTITY = Layout()
