"""tf_sparsify: communication-efficient distributed training for TensorFlow and Keras 3."""

from tf_sparsify import distribute, theory
from tf_sparsify.compressors import (
    BF16,
    FP16,
    QSGD,
    Compressor,
    Identity,
    PowerSGD,
    RandomK,
    ScaledSign,
    SparseAllReduce,
    TernGrad,
    TopK,
)
from tf_sparsify.exchange import GradientExchange
from tf_sparsify.heuristics import dgc_density_schedule
from tf_sparsify.keras import (
    CompressionDiagnostics,
    CompressionStats,
    DensityWarmup,
    SparsifiedOptimizer,
)
from tf_sparsify.options import ExchangeOptions
from tf_sparsify.pipeline import GradientPipeline
from tf_sparsify.transports import Transport

__version__ = "0.1.0"

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "CompressionDiagnostics",
    "CompressionStats",
    "Compressor",
    "DensityWarmup",
    "ExchangeOptions",
    "GradientExchange",
    "GradientPipeline",
    "Identity",
    "PowerSGD",
    "RandomK",
    "ScaledSign",
    "SparseAllReduce",
    "SparsifiedOptimizer",
    "TernGrad",
    "TopK",
    "Transport",
    "dgc_density_schedule",
    "distribute",
    "theory",
]
