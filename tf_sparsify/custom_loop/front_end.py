"""What every front end of a compression state shows: the custom-loop ``GradientExchange`` and
the Keras optimizers (which build on this layer) share these members."""

from __future__ import annotations

from tf_sparsify.compressors.base import Compressor
from tf_sparsify.core.pipeline import GradientPipeline
from tf_sparsify.core.state_views import StateViews
from tf_sparsify.core.transport import Transport


class FrontEnd(StateViews):
    """:class:`~tf_sparsify.core.state.StateViews` of the ``CompressionState`` held as
    ``self._state``, plus its pipeline, the pipeline's compressor and the transport."""

    @property
    def pipeline(self) -> GradientPipeline:
        """How each step's gradients are compressed (compressor, options, plan)."""
        return self._state.pipeline

    @property
    def compressor(self) -> Compressor:
        return self.pipeline.compressor

    @property
    def transport(self) -> Transport:
        """How the payloads travel between replicas."""
        return self._state.transport

    def set_compressor(self, compressor: Compressor) -> None:
        """Use ``compressor`` from the next trace of the step on (e.g. a new density; a step
        traced before must be retraced). Everything else stays; residuals and momenta carry
        over. Under Horovod every rank must make the same change (a rank that does not fails
        by name)."""
        self._state.set_pipeline(self.pipeline.with_compressor(compressor))

    def enable_diagnostics(self, every: int) -> None:
        """Record the diagnostics every ``every`` steps (0: off) from the next trace of the
        step on (a step traced before must be retraced). A built state makes their variables
        here: call it under the strategy scope it was built in."""
        self._state.enable_record(self._state.diagnostics, "diagnostics_every", every)

    def enable_grad_sq_norms(self, every: int) -> None:
        """Record each unit's ``||g||^2`` every ``every`` steps (0: off; see
        :attr:`grad_sq_norms`), as :meth:`enable_diagnostics` does. Unlike the diagnostics it
        leaves the step's routes as they are: a recorded step costs one pass over the
        gradients."""
        self._state.enable_record(self._state.grad_sq_norms, "grad_sq_norms_every", every)
