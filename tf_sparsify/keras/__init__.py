"""Keras front end: the optimizer wrapper and its callbacks."""

from tf_sparsify.keras.auto_compression import AutoCompression
from tf_sparsify.keras.callbacks import CompressionStats
from tf_sparsify.keras.diagnostics import CompressionDiagnostics, plot_diagnostics
from tf_sparsify.keras.optimizer import SparsifiedOptimizer
from tf_sparsify.keras.warmup import DensityWarmup
from tf_sparsify.keras.wrapped import find_sparsified, skip_gradient_all_reduce

__all__ = [
    "AutoCompression",
    "CompressionDiagnostics",
    "CompressionStats",
    "DensityWarmup",
    "SparsifiedOptimizer",
    "find_sparsified",
    "skip_gradient_all_reduce",
    "plot_diagnostics",
]
