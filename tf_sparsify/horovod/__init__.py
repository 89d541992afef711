"""Horovod front end: the same gradient pipeline with Horovod as the transport.

- :class:`DistributedOptimizer`: the Keras 3 wrapper for ``model.compile`` / ``model.fit``.
- :class:`GradientExchange` and :class:`DistributedGradientTape`: custom training loops.
- :class:`HorovodCollective`: the transport itself (grouped all-gather / all-reduce).
- :func:`init`: ``hvd.init`` plus the process sets of the hierarchical exchange
  (``ranks_per_node=``, see :mod:`tf_sparsify.horovod.hierarchy`).
- ``FP16Compression``, ``BF16Compression``, ``RandomKCompression``, ``TopKCompression``:
  objects for Horovod's own ``compression=`` argument.
- :func:`broadcast_variables`, :class:`BroadcastGlobalVariablesCallback`,
  :class:`MetricAverageCallback`, :func:`is_rank0`, :func:`log0`, :func:`verbose0`.

Call ``hvd.init()`` (``import horovod.tensorflow as hvd``) before using any of them, and run
under ``horovodrun -np N --gloo python train.py``.
"""

from tf_sparsify.horovod.broadcast import broadcast_variables
from tf_sparsify.horovod.callbacks import BroadcastGlobalVariablesCallback, MetricAverageCallback
from tf_sparsify.horovod.collective import HorovodCollective
from tf_sparsify.horovod.compression import (
    BF16Compression,
    FP16Compression,
    RandomKCompression,
    TopKCompression,
)
from tf_sparsify.horovod.elastic import ElasticState
from tf_sparsify.horovod.error_memory import gather_error_memory, scatter_error_memory
from tf_sparsify.horovod.hierarchy import Topology, init
from tf_sparsify.horovod.optimizer import DistributedOptimizer
from tf_sparsify.horovod.rank0 import is_rank0, log0, verbose0
from tf_sparsify.horovod.tape import DistributedGradientTape, GradientExchange
from tf_sparsify.horovod.transport import HorovodTransport

__all__ = [
    "BF16Compression",
    "BroadcastGlobalVariablesCallback",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "ElasticState",
    "FP16Compression",
    "GradientExchange",
    "HorovodCollective",
    "HorovodTransport",
    "MetricAverageCallback",
    "RandomKCompression",
    "TopKCompression",
    "Topology",
    "broadcast_variables",
    "gather_error_memory",
    "init",
    "is_rank0",
    "log0",
    "scatter_error_memory",
    "verbose0",
]
