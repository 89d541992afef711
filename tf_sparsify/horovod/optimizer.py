"""``DistributedOptimizer``: the Keras wrapper with Horovod as its transport."""

from __future__ import annotations

from typing import Any

import keras

from tf_sparsify.compressors.base import Compressor
from tf_sparsify.compressors.dense import Identity
from tf_sparsify.horovod.byte_counters import HorovodByteCounters
from tf_sparsify.horovod.transport import HorovodTransport
from tf_sparsify.keras.optimizer import SparsifiedOptimizer


@keras.saving.register_keras_serializable(package="tf_sparsify")
class DistributedOptimizer(HorovodByteCounters, SparsifiedOptimizer):
    """A :class:`~tf_sparsify.keras.SparsifiedOptimizer` whose payloads travel by Horovod (its
    transport is a :class:`~tf_sparsify.horovod.HorovodTransport`).

    For ``model.compile`` / ``model.fit`` under ``horovodrun``: sparse payloads by one
    ``hvd.grouped_allgather`` of their bytes, summable ones by ``hvd.grouped_allreduce``
    (``Sum``, one group per dtype), and the sum of the decompressed payloads is divided by
    ``hvd.size()`` (each rank's loss is its own mean). Everything else (options, residuals,
    ``bytes_sent``, serialization) is the wrapper's; ``compressor=None`` means ``Identity()``,
    plain Horovod averaging.

    Before the first exchange of a process the ranks compare fingerprints of their plans, and
    every later step's first gather carries them too; ranks configured differently (also by a
    :meth:`set_compressor` on one rank only) get an ``InvalidArgumentError`` naming what
    differs (see :mod:`tf_sparsify.horovod.check`) instead of waiting for each other.

    Horovod's ops do not run under XLA: Keras' default ``jit_compile="auto"`` resolves to
    ``False`` for a model compiled with this optimizer, and ``jit_compile=True`` fails at the
    first step with a ValueError that says to pass ``jit_compile=False``. With mixed
    precision, put the ``LossScaleOptimizer`` inside (``DistributedOptimizer(
    LossScaleOptimizer(SGD()), ...)``) and compile with ``auto_scale_loss=False``: an outer
    one decides on each rank's own gradients whether to step, and ranks that decide
    differently would wait on each other's collectives forever.

    ``ranks_per_node``: the hierarchical exchange (see :mod:`tf_sparsify.horovod.hierarchy`):
    dense sums inside each node, each rank compresses its shard of the node's sum and
    exchanges it with the same shard of every other node. Needs
    ``tf_sparsify.horovod.init(ranks_per_node=...)`` at start-up; ``None`` is the flat
    exchange.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        compressor: Compressor | None = None,
        ranks_per_node: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(
            optimizer,
            Identity() if compressor is None else compressor,
            transport=HorovodTransport(ranks_per_node),
            **kwargs,
        )

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        if self.ranks_per_node is not None:
            config["ranks_per_node"] = self.ranks_per_node
        return config
