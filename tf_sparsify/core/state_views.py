"""Read-only views of a state core, shared by the front ends that hold one."""

from __future__ import annotations

from tf_sparsify.core.checkpoint import StateCheckpoint
from tf_sparsify.core.plan import Unit
from tf_sparsify.core.state import CompressionState


class StateViews:
    """Read-only views of a ``CompressionState`` held as ``self._state``, shared by the front
    ends (the Keras optimizers and Horovod's ``GradientExchange``)."""

    _state: CompressionState

    @property
    def exchange_checkpoint(self) -> StateCheckpoint:
        """The checkpoint entry of the exchange state (every replica's rows, checked before
        a restore assigns anything; see :mod:`tf_sparsify.core.checkpoint`)."""
        return self._state.checkpoint

    @property
    def units(self) -> list[Unit]:
        """The planned messages (:class:`~tf_sparsify.core.plan.Unit`) of one step."""
        return list(self._state.units)

    @property
    def residuals(self) -> list:
        """The residual variable of each variable (``None`` where there is none)."""
        return list(self._state.residuals)

    @property
    def momenta(self) -> list:
        """The momentum buffer of each variable (momentum correction), or ``None``."""
        return list(self._state.momenta)

    @property
    def in_flight(self) -> list:
        """The gradient in flight of each variable of a late bucket (``late_buckets``), or
        ``None``."""
        return list(self._state.in_flight)

    @property
    def exchange_steps(self):
        """The number of exchanges done (it keys random choices)."""
        return self._state.step

    @property
    def bytes_sent(self):
        """Payload bytes this replica sent, summed over steps."""
        return self._state.bytes_sent

    @property
    def dense_bytes(self):
        """What the same steps would have sent uncompressed."""
        return self._state.dense_bytes

    @property
    def wire_bytes_per_step(self) -> int:
        """Payload bytes of a step in which every variable has a gradient."""
        return self._state.bytes_per_step[0]

    @property
    def dense_bytes_per_step(self) -> int:
        return self._state.bytes_per_step[1]

    @property
    def diagnostics(self):
        """The ``[units, 5]`` diagnostics record (``None`` until enabled and built); rows follow
        :attr:`diagnostics_names`, columns :data:`~tf_sparsify.core.measurements.STAT_NAMES`."""
        return self._state.diagnostics.values

    @property
    def diagnostics_step(self):
        """The number of steps done when the diagnostics were last recorded (0: never)."""
        return self._state.diagnostics.step

    @property
    def diagnostics_every(self) -> int:
        """Steps between two diagnostics records (0: off)."""
        return self._state.diagnostics.every

    @property
    def grad_sq_norms(self):
        """The ``[units, 1]`` record of each planned message's ``||g||^2`` (its fresh gradients
        as the exchange receives them; the mean over replicas), ``None`` until enabled and
        built; rows follow :attr:`diagnostics_names`."""
        return self._state.grad_sq_norms.values

    @property
    def grad_sq_norms_step(self):
        """The number of steps done when the gradient norms were last recorded (0: never)."""
        return self._state.grad_sq_norms.step

    @property
    def grad_sq_norms_every(self) -> int:
        """Steps between two gradient-norm records (0: off)."""
        return self._state.grad_sq_norms.every

    @property
    def diagnostics_names(self) -> tuple[str, ...]:
        """The name of each planned message: the variable's path, or ``global_<dtype>``."""
        return self._state.names
