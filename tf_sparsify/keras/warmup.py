"""``DensityWarmup``: a density schedule over epochs (DGC's sparsity warm-up).

A compressor's ``k`` is a static part of the traced train step, so at each epoch whose density
differs from the current one the callback gives the optimizer a compressor with the new density
(:meth:`~tf_sparsify.keras.SparsifiedOptimizer.set_compressor`, which also recomputes the wire
bytes per step) and forces Keras to retrace the train step. A retrace costs one trace per
change (a few with DGC's schedule); residuals and momenta carry over unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from tf_sparsify.heuristics.warmup import with_density
from tf_sparsify.keras.wrapped import find_sparsified


class DensityWarmup(keras.callbacks.Callback):
    """Set the compressor's density from ``schedule(epoch)`` at the start of every epoch.

    Args:
        schedule: ``epoch -> density`` in (0, 1], e.g.
            :func:`~tf_sparsify.heuristics.dgc_density_schedule` ``(0.001)``.

    The epoch logs get ``scheduled_density``; :attr:`densities` lists the density of each
    epoch run.
    """

    def __init__(self, schedule: Callable[[int], float]):
        super().__init__()
        if not callable(schedule):
            raise ValueError(f"`schedule` must be callable; received schedule={schedule!r}")
        self.schedule = schedule
        self.densities: list[float] = []

    def on_epoch_begin(self, epoch, logs=None):
        opt = find_sparsified(self.model.optimizer)
        if opt is None:
            raise ValueError("DensityWarmup needs a model compiled with a SparsifiedOptimizer.")
        density = float(self.schedule(epoch))
        current = opt.compressor.get_config()
        if current.get("ratio") != density or current.get("k") is not None:
            opt.set_compressor(with_density(opt.compressor, density))
            self.model.make_train_function(force=True)
        self.densities.append(density)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None and self.densities:
            logs["scheduled_density"] = self.densities[-1]
