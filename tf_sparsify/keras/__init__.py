"""Keras front end: the optimizer wrapper and its callbacks."""

from tf_sparsify.keras.callbacks import CompressionStats
from tf_sparsify.keras.optimizer import SparsifiedOptimizer, find_sparsified

__all__ = ["CompressionStats", "SparsifiedOptimizer", "find_sparsified"]
