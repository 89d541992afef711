"""Practical TopK heuristics (DGC) and in-step measurements, each a small piece with one job.

* :mod:`~tf_sparsify.heuristics.clipping`: local gradient clipping before accumulation.
* :mod:`~tf_sparsify.heuristics.warmup`: density warm-up schedules.
* :mod:`~tf_sparsify.heuristics.measure`: norm gap, empirical beta, residual norm and density.

The pipeline (:class:`~tf_sparsify.pipeline.GradientPipeline`) composes them, so every front end
(Keras, tf.distribute, Horovod) gets them from one place. DGC's momentum correction and
momentum factor masking are rules of the error memory: :mod:`tf_sparsify.memory`.
"""

from tf_sparsify.heuristics.clipping import clip_by_local_norm, local_clip_threshold
from tf_sparsify.heuristics.measure import (
    STAT_NAMES,
    beta_bound,
    gap_bound,
    summarize,
    unit_stats,
)
from tf_sparsify.heuristics.warmup import DensitySchedule, dgc_density_schedule, with_density

__all__ = [
    "STAT_NAMES",
    "DensitySchedule",
    "beta_bound",
    "clip_by_local_norm",
    "dgc_density_schedule",
    "gap_bound",
    "local_clip_threshold",
    "summarize",
    "unit_stats",
    "with_density",
]
