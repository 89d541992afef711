"""Practical TopK heuristics (DGC), each a small piece with one job.

* :mod:`~tf_sparsify.heuristics.clipping`: local gradient clipping before accumulation.
* :mod:`~tf_sparsify.heuristics.warmup`: density warm-up schedules.

The pipeline (:class:`~tf_sparsify.core.pipeline.GradientPipeline`) composes them, so every front
end
(Keras, tf.distribute, Horovod) gets them from one place. DGC's momentum correction and
momentum factor masking are rules of the error memory
(:mod:`tf_sparsify.compressors.error_memory`); what a step
measures (norm gap, empirical beta, residual norm, density) is :mod:`tf_sparsify.core.measurements`.
"""

from tf_sparsify.heuristics.clipping import clip_by_local_norm, local_clip_threshold
from tf_sparsify.heuristics.warmup import DensitySchedule, dgc_density_schedule, with_density

__all__ = [
    "DensitySchedule",
    "clip_by_local_norm",
    "dgc_density_schedule",
    "local_clip_threshold",
    "with_density",
]
