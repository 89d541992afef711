"""Network what-if: predicted step time of each exchange method from alpha-beta cost models.

A step is ``compute`` (forward, backward, optimizer) + ``overhead`` (the compressor's own work:
select, encode, decode; measured, an input) + ``comm`` (the exchange); with ``overlap="full"``
the step is ``overhead + max(compute, comm)``; ``overlap="backprop"`` starts each tensor's
exchange when backprop has made it, and ``late_buckets`` sends the first tensor's (``"last"``)
or every one (``"all"``) one step late, while the next step computes. The exchange is a
sequence of collectives, each costing ``c + rounds * alpha + bytes_sent * beta`` on its link.

This module gathers the model's names in one place (``tfs.theory`` re-exports them too); they
live in:

- :mod:`tf_sparsify.step_model.network`: :class:`Link`, :class:`Cluster`, the collectives
  (:func:`all_reduce`, :func:`all_gather`, :func:`all_to_all`) and :func:`link_time`.
- :mod:`tf_sparsify.step_model.shapes`: :class:`Layers` (a model's tensor shapes),
  :func:`mlp_layers`, :data:`MLP10M`.
- :mod:`tf_sparsify.step_model.methods`: the exchange methods (:class:`DenseAllReduce`,
  :class:`TopKAllGather`, :class:`TopKSplitReduce`, :class:`QSGDAllGather`,
  :class:`PowerSGDAllReduce`, :class:`Hierarchical`): payload bytes and collectives.
- :mod:`tf_sparsify.step_model.predict`: :func:`predict`, :func:`sweep`,
  :func:`winner_ranges`, :func:`crossover_workers`, and the step's timeline (:func:`step_time`,
  :func:`unit_comms`).

The command line, ``python -m tf_sparsify whatif``, is :mod:`tf_sparsify.analysis.whatif_cli`.
"""

from __future__ import annotations

from tf_sparsify.step_model.methods import (
    MAX_INT32_ELEMENTS,
    DenseAllReduce,
    Hierarchical,
    Method,
    PowerSGDAllReduce,
    QSGDAllGather,
    TopKAllGather,
    TopKSplitReduce,
    topk_entries,
)
from tf_sparsify.step_model.network import (
    SCHEDULES,
    Cluster,
    Link,
    Schedule,
    Transfer,
    all_gather,
    all_reduce,
    all_to_all,
    link_time,
    phase_rounds,
)
from tf_sparsify.step_model.predict import (
    BACKWARD_FRACTION,
    LATE_BUCKETS,
    OVERLAPS,
    Late,
    Overlap,
    Prediction,
    bytes_sent,
    comm_time,
    crossover_workers,
    predict,
    step_time,
    sweep,
    unit_comms,
    winner,
    winner_ranges,
)
from tf_sparsify.step_model.shapes import MLP10M, Layers, mlp_layers

__all__ = [
    "BACKWARD_FRACTION",
    "LATE_BUCKETS",
    "MAX_INT32_ELEMENTS",
    "MLP10M",
    "OVERLAPS",
    "SCHEDULES",
    "Cluster",
    "DenseAllReduce",
    "Hierarchical",
    "Late",
    "Layers",
    "Link",
    "Method",
    "Overlap",
    "PowerSGDAllReduce",
    "Prediction",
    "QSGDAllGather",
    "Schedule",
    "TopKAllGather",
    "TopKSplitReduce",
    "Transfer",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "bytes_sent",
    "comm_time",
    "crossover_workers",
    "link_time",
    "mlp_layers",
    "phase_rounds",
    "predict",
    "step_time",
    "sweep",
    "topk_entries",
    "unit_comms",
    "winner",
    "winner_ranges",
]
