"""Ways to send a gradient: single-round codecs (``compress(tensor) -> (payload, ctx)``,
``decompress(payload, ctx)``) and multi-round exchanges (PowerSGD, SparseAllReduce)."""

from tf_sparsify.compat import renamed
from tf_sparsify.compressors.auto import Auto
from tf_sparsify.compressors.base import (
    Codec,
    Compressor,
    Context,
    MultiRoundMethod,
    deserialize,
    serialize,
)
from tf_sparsify.compressors.dense import BF16, FP16, Identity
from tf_sparsify.compressors.powersgd import PowerSGD
from tf_sparsify.compressors.qsgd import QSGD
from tf_sparsify.compressors.randomk import RandomK
from tf_sparsify.compressors.sparse_allreduce import SparseAllReduce
from tf_sparsify.compressors.ternary import ScaledSign, TernGrad
from tf_sparsify.compressors.topk import TopK

__all__ = [
    "BF16",
    "Auto",
    "FP16",
    "QSGD",
    "Codec",
    "Compressor",
    "Context",
    "Identity",
    "MultiRoundMethod",
    "PowerSGD",
    "RandomK",
    "ScaledSign",
    "SparseAllReduce",
    "TernGrad",
    "TopK",
    "deserialize",
    "serialize",
]

__getattr__ = renamed(globals(), {"MultiRoundExchange": "MultiRoundMethod"})
