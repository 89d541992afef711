"""The what-if's exchange methods: each one's payload bytes and the collectives of its step.

Methods (``n`` parameters, ``k`` entries sent, ``v`` value and ``i`` index bytes per entry):

- :class:`DenseAllReduce`: fp32 (``v = 4``) or FP16/BF16 (``v = 2``), summable: all-reduce of
  ``n v`` bytes.
- :class:`TopKAllGather`: ``k v`` bytes of values and the packed index code of
  :class:`tf_sparsify.TopK` (Elias-Fano, about ``k (2 + log2(n / k))`` bits) per worker, or
  ``k i`` bytes of indices when ``index_bytes`` is given; gathered (the supports differ).
- :class:`TopKSplitReduce`: split-and-reduce (Ok-Topk style): all-to-all of the ``k`` entries to
  the owners of their index slices, each owner re-selects ``k / P`` entries of its sum,
  all-gather of those: ``2 (P - 1) / P * k (v + i)`` bytes, flat in ``P`` (indices assumed
  spread evenly over the slices).
- :class:`QSGDAllGather`: a signed level per entry (int8 up to 127 levels, else int16) and a
  float32 norm per bucket, gathered (not summable).
- :class:`PowerSGDAllReduce`: rank ``r``; a tensor of 2+ dimensions is a matrix ``a x b`` (``b``
  its last dimension, as :class:`tf_sparsify.PowerSGD`); where ``r (a + b) < a b`` it sends
  float32 factors ``P (a x r)`` and ``Q (b x r)``: two all-reduces in sequence, ``4 r sum(a)``
  bytes (with the dense tensors) then ``4 r sum(b)``, flat in ``P``.
- :class:`Hierarchical`: a dense fp32 all-reduce inside each node on the intra-node link
  (reduce-scatter, then all-gather of the result) and the inner method across the nodes on
  the inter-node link, each local rank carrying a shard, so a node's link carries one payload
  and the ``P`` of the compressed exchange is the number of nodes.

The costs of the collectives are in :mod:`tf_sparsify.step_model.network`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Protocol

from tf_sparsify.common.checks import check_number
from tf_sparsify.compressors.powersgd import PowerSGD
from tf_sparsify.compressors.qsgd import QSGD
from tf_sparsify.compressors.topk import TopK
from tf_sparsify.ops.index_code import index_code_bytes
from tf_sparsify.step_model.network import (
    Cluster,
    Transfer,
    all_gather,
    all_reduce,
    all_to_all,
)
from tf_sparsify.step_model.shapes import Layers

MAX_INT32_ELEMENTS = 2**31 - 1


class Method(Protocol):
    name: str

    def payload_bytes(self, layers: Layers) -> float:
        """Bytes of one worker's compressed payload for the whole model."""

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        """The collectives of one step, in order."""


@functools.lru_cache(maxsize=4096, typed=True)
def topk_entries(size: int, ratio: float) -> int:
    """How many entries :class:`tf_sparsify.TopK` selects of ``size`` at ``ratio`` (remembered:
    a sweep asks it for the same tensors and ratios thousands of times; ``typed``: a float32
    ratio's decimal is not its double's)."""
    return TopK(ratio=ratio).num_selected(size)


def _index_bytes(size: int, index_bytes: float | None) -> float:
    """int32 indices while they fit, int64 beyond, unless ``index_bytes`` says otherwise."""
    if index_bytes is not None:
        return index_bytes
    return 8 if size > MAX_INT32_ELEMENTS else 4


def _flat_all_reduce(size: float, cluster: Cluster) -> Transfer:
    """An all-reduce of ``size`` bytes over all the cluster's workers."""
    return all_reduce(size, cluster.workers, cluster.schedule, cluster.flat_level)


def _flat_all_gather(size: float, cluster: Cluster) -> Transfer:
    """An all-gather of ``size`` bytes per worker over all the cluster's workers."""
    return all_gather(size, cluster.workers, cluster.schedule, cluster.flat_level)


@dataclass(frozen=True)
class DenseAllReduce:
    """Summable dense payload of ``value_bytes`` per entry (4: fp32, 2: FP16/BF16); all-reduce."""

    value_bytes: float = 4
    name: str = "dense"

    def __post_init__(self):
        check_number("value_bytes", self.value_bytes, low=0, low_open=True)

    def payload_bytes(self, layers: Layers) -> float:
        return layers.num_params * self.value_bytes

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        return [_flat_all_reduce(self.payload_bytes(layers), cluster)]


@dataclass(frozen=True)
class TopKAllGather:
    """TopK ``ratio`` per tensor, ``value_bytes`` per value and the packed index code (or
    ``index_bytes`` per index); all-gather."""

    ratio: float = 0.01
    value_bytes: float = 4
    index_bytes: float | None = None
    name: str = "topk"

    def __post_init__(self):
        TopK(ratio=self.ratio)  # checks ratio
        check_number("value_bytes", self.value_bytes, low=0, low_open=True)
        if self.index_bytes is not None:
            check_number("index_bytes", self.index_bytes, low=0, low_open=True)

    def entries(self, layers: Layers) -> int:
        return sum(topk_entries(d, self.ratio) for d in layers.sizes)

    def payload_bytes(self, layers: Layers) -> float:
        """``k`` values and, by default, :class:`tf_sparsify.TopK`'s packed index code."""
        total = 0.0
        for d in layers.sizes:
            k = topk_entries(d, self.ratio)
            indices = index_code_bytes(d, k) if self.index_bytes is None else k * self.index_bytes
            total += k * self.value_bytes + indices
        return total

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        return [_flat_all_gather(self.payload_bytes(layers), cluster)]


@dataclass(frozen=True)
class TopKSplitReduce(TopKAllGather):
    """TopK entries reduced by split-and-reduce: all-to-all to slice owners, re-selection of
    ``k / P`` per owner, all-gather of those (``2 (P - 1) / P * k (v + i)`` bytes per worker)."""

    name: str = "topk-sar"

    def payload_bytes(self, layers: Layers) -> float:
        """``k`` values and indices (int32, int64 past 2^31 entries: not packed)."""
        return sum(
            topk_entries(d, self.ratio) * (self.value_bytes + _index_bytes(d, self.index_bytes))
            for d in layers.sizes
        )

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        p, level, payload = cluster.workers, cluster.flat_level, self.payload_bytes(layers)
        per_node = cluster.gpus_per_node if level == "inter" else 1
        return [all_to_all(payload, p, level, per_node), _flat_all_gather(payload / p, cluster)]


@dataclass(frozen=True)
class QSGDAllGather:
    """QSGD with ``levels`` (int8 levels up to 127, else int16) and a float32 norm per bucket of
    ``bucket_size`` (None: the whole tensor); all-gather."""

    levels: int = 4
    bucket_size: int | None = None
    name: str = "qsgd"

    def __post_init__(self):
        self.compressor()  # checks levels and bucket_size

    def compressor(self) -> QSGD:
        return QSGD(self.levels, bucket_size=self.bucket_size)

    def payload_bytes(self, layers: Layers) -> float:
        """What :class:`tf_sparsify.QSGD` sends for each tensor."""
        qsgd = self.compressor()
        return sum(qsgd.wire_bytes(d) for d in layers.sizes)

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        return [_flat_all_gather(self.payload_bytes(layers), cluster)]


@dataclass(frozen=True)
class PowerSGDAllReduce:
    """Rank ``rank`` factors of every matrix where they are smaller; two all-reduces (fp32)."""

    rank: int = 4
    name: str = "powersgd"

    def __post_init__(self):
        PowerSGD(self.rank)  # checks rank

    def factor_entries(self, layers: Layers) -> tuple[int, int]:
        """``(entries with the P factors, entries of the Q factors)``: dense tensors (vectors,
        and matrices where ``r (a + b) >= a b``) travel with ``P``."""
        powersgd = PowerSGD(self.rank)
        first = second = 0
        for shape in layers.shapes:
            dims = powersgd.matrix_shape(shape)
            if dims is None:
                first += math.prod(shape)
            else:
                first, second = first + self.rank * dims[0], second + self.rank * dims[1]
        return first, second

    def payload_bytes(self, layers: Layers) -> float:
        return 4 * sum(self.factor_entries(layers))

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        return [_flat_all_reduce(4 * n, cluster) for n in self.factor_entries(layers) if n]


@dataclass(frozen=True)
class Hierarchical:
    """Dense fp32 all-reduce inside each node (intra link), ``inner`` across the nodes."""

    inner: Method
    name: str = ""

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", f"hier-{self.inner.name}")

    def payload_bytes(self, layers: Layers) -> float:
        return self.inner.payload_bytes(layers)

    def transfers(self, layers: Layers, cluster: Cluster) -> list[Transfer]:
        g = cluster.gpus_per_node
        inside = [all_reduce(4 * layers.num_params, g, cluster.schedule, "intra")] if g > 1 else []
        across = replace(cluster, gpus_per_node=1, intra=None)
        return inside + (self.inner.transfers(layers, across) if cluster.nodes > 1 else [])
