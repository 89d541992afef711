"""tf_sparsify: communication-efficient distributed training for TensorFlow and Keras 3."""

from tf_sparsify import compat, distribute
from tf_sparsify.analysis import theory
from tf_sparsify.common.autograph import leave_unconverted
from tf_sparsify.compressors import (
    BF16,
    FP16,
    QSGD,
    Auto,
    Compressor,
    Identity,
    PowerSGD,
    RandomK,
    ScaledSign,
    SparseAllReduce,
    TernGrad,
    TopK,
)
from tf_sparsify.core.options import ExchangeOptions
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.transport import Transport
from tf_sparsify.custom_loop.auto_steps import AutoSteps
from tf_sparsify.custom_loop.gradient_exchange import GradientExchange
from tf_sparsify.heuristics import dgc_density_schedule
from tf_sparsify.keras import (
    AutoCompression,
    CompressionDiagnostics,
    CompressionStats,
    DensityWarmup,
    SparsifiedOptimizer,
)

__version__ = "0.1.0"

compat.install()
leave_unconverted()

__all__ = [
    "BF16",
    "FP16",
    "QSGD",
    "Auto",
    "AutoCompression",
    "AutoSteps",
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
