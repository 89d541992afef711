"""What the Horovod front ends (the Keras ``DistributedOptimizer`` and the custom-loop
``GradientExchange``) show of their :class:`~tf_sparsify.horovod.HorovodTransport`."""

from __future__ import annotations

import tensorflow as tf


class HorovodByteCounters:
    """Mixin of a front end whose ``transport`` is a ``HorovodTransport``: its hierarchy and
    its byte counters (not checkpointed)."""

    @property
    def ranks_per_node(self) -> int | None:
        """The ranks of a node in the hierarchical exchange (``None``: the flat exchange)."""
        return self.transport.ranks_per_node

    @property
    def bytes_to_horovod(self) -> tf.Variable:
        """Payload bytes this process has handed to Horovod's collectives; with
        ``ranks_per_node``, the bytes that crossed nodes."""
        return self.transport.horovod_bytes

    @property
    def bytes_across_nodes(self) -> tf.Variable | None:
        """With ``ranks_per_node``: the payload bytes this process sent across nodes."""
        return self.transport.bytes_across_nodes

    @property
    def bytes_within_nodes(self) -> tf.Variable | None:
        """With ``ranks_per_node``: the dense bytes this process handed to the reduce-scatter
        and all-gather inside its node."""
        return self.transport.bytes_within_nodes
