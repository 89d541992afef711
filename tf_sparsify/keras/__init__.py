"""Keras front end: the optimizer wrapper and its callbacks."""

from tf_sparsify.keras.callbacks import CompressionStats
from tf_sparsify.keras.diagnostics import CompressionDiagnostics, plot_diagnostics
from tf_sparsify.keras.optimizer import SparsifiedOptimizer, find_sparsified
from tf_sparsify.keras.warmup import DensityWarmup

__all__ = [
    "CompressionDiagnostics",
    "CompressionStats",
    "DensityWarmup",
    "SparsifiedOptimizer",
    "find_sparsified",
    "plot_diagnostics",
]
