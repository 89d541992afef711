"""``AutoCompression``: the Keras callback that runs an ``Auto`` compressor's decisions.

It attaches :class:`~tf_sparsify.custom_loop.auto_steps.AutoSteps` to the model's
``SparsifiedOptimizer`` when training begins and calls it after every batch; when the settings
change, Keras retraces the step before the next one (``make_train_function(force=True)``).
"""

from __future__ import annotations

from typing import Any

import keras

from tf_sparsify.core.auto_tuner import AutoTuner, Decision
from tf_sparsify.custom_loop.auto_steps import AutoSteps
from tf_sparsify.keras.wrapped import find_sparsified
from tf_sparsify.step_model.link_fit import LinkMeasurement


class AutoCompression(keras.callbacks.Callback):
    """Chooses the setting of each unit of the optimizer's :class:`~tf_sparsify.Auto`; the
    arguments are :class:`~tf_sparsify.custom_loop.auto_steps.AutoSteps`'.

    :attr:`decisions` lists every decision, :attr:`links` every link measured (with the step);
    the epoch logs get ``auto_measured_step_ms``, ``auto_predicted_step_ms`` and
    ``auto_units_<setting>`` (how many units use it).
    """

    def __init__(self, interval: int = 100, link: LinkMeasurement | None = None, **options: Any):
        super().__init__()
        #: the decisions' driver (``options``: ``link_every``, ``eta``, ``critical_level``,
        #: ``pinned``, ``verbose``)
        self.steps = AutoSteps(interval, link, **options)

    @property
    def decisions(self) -> list[Decision]:
        return self.steps.decisions

    @property
    def link(self) -> LinkMeasurement | None:
        return self.steps.link

    @property
    def links(self) -> list[tuple[int, LinkMeasurement]]:
        return self.steps.links

    @property
    def overhead(self) -> float:
        """Seconds spent measuring and deciding (not training)."""
        return self.steps.overhead

    @property
    def tuner(self) -> AutoTuner | None:
        return self.steps.tuner

    def on_train_begin(self, logs=None):
        opt = find_sparsified(self.model.optimizer)
        if opt is None:
            raise ValueError(
                "AutoCompression needs a model compiled with a SparsifiedOptimizer whose "
                f"compressor is tf_sparsify.Auto(); got optimizer={self.model.optimizer!r}"
            )
        with self.model.distribute_strategy.scope():  # a built optimizer makes the record
            retrace = self.steps.attach(opt)
        if retrace:  # the gradient norms, from the step's next trace on
            self.model.make_train_function(force=True)

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.pause()  # the gap between epochs is no step

    def on_train_batch_end(self, batch, logs=None):
        if self.steps.step_done():
            self.model.make_train_function(force=True)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or not self.decisions:
            return
        last = self.decisions[-1]
        logs["auto_measured_step_ms"] = 1e3 * last.measured
        logs["auto_predicted_step_ms"] = 1e3 * last.predicted
        for name in self.tuner.auto.names:
            logs[f"auto_units_{name}"] = float(last.settings.count(name))
