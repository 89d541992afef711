"""Custom training loops: :class:`GradientExchange` keeps the state and exchanges each step;
:class:`AutoSteps` runs an ``Auto`` compressor's decisions between steps."""

from tf_sparsify.custom_loop.auto_steps import AutoSteps
from tf_sparsify.custom_loop.gradient_exchange import GradientExchange

__all__ = ["AutoSteps", "GradientExchange"]
