"""Custom training loops: :class:`GradientExchange` keeps the state and exchanges each step."""

from tf_sparsify.custom_loop.gradient_exchange import GradientExchange

__all__ = ["GradientExchange"]
