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
