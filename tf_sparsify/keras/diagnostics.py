"""``CompressionDiagnostics``: the papers' quantities on your own model, into ``history``.

The optimizer sees the gradients, a callback does not: with diagnostics on, the
:class:`~tf_sparsify.keras.SparsifiedOptimizer` measures every N steps, inside the train step
(``tf.cond`` on its step counter, so other steps pay one comparison), what it compressed and
stores five numbers per message in a small optimizer variable (see
:mod:`tf_sparsify.core.measurements`). This callback reads that record after each batch and
turns it into:

* ``norm_gap``: ``||x - C(x)|| / ||x||`` of the vector actually compressed (with error feedback
  ``x = residual + gradient``), and ``norm_gap_bound``, its worst case (``sqrt(1 - K/n)`` for
  TopK; for several messages the largest of theirs); ``grad_norm_gap``, the same compressor's
  gap on the fresh gradient alone (without the residual it would otherwise be added to);
* ``beta`` and ``beta_bound`` for unbiased quantizers: ``||Q(v) - v||^2 / ||v||^2`` on the real
  gradient against ``variance_bound(d)``;
* ``residual_norm`` (after the step), ``grad_norm``, ``density`` (entries sent / entries) and
  ``wire_density`` (what the compressors promise);
* with ``per_layer=True`` the same keys suffixed ``/<variable path>`` per message.

Under ``tf.distribute`` each replica measures its own step and the record is the mean over
replicas. Epoch logs (and so ``history``) get the mean of the epoch's records;
:attr:`CompressionDiagnostics.records` keeps every record, and :func:`plot_diagnostics` draws
them to a PNG.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_sparsify.common.checks import check_int
from tf_sparsify.core.measurements import summarize
from tf_sparsify.keras.summaries import write_scalar
from tf_sparsify.keras.wrapped import find_sparsified


class CompressionDiagnostics(keras.callbacks.Callback):
    """Records norm gaps, empirical beta, residual norms and density every ``every_n_steps``.

    Args:
        every_n_steps: measure on steps ``0, N, 2N, ...`` of the optimizer (turns the
            optimizer's ``diagnostics_every`` on; the step is retraced if needed).
        log_dir: also write every record (per-layer keys included) as TensorBoard scalars
            ``diagnostics/<key>`` at the optimizer step.
        per_layer: put the per-message keys into the epoch logs too (they are always in
            :attr:`records` and TensorBoard).

    Attributes:
        records: one dict per measurement: ``step`` (steps done when measured), ``epoch``,
            and the keys above.
    """

    def __init__(
        self, every_n_steps: int = 50, log_dir: str | None = None, per_layer: bool = False
    ):
        super().__init__()
        self.every_n_steps = check_int("every_n_steps", every_n_steps)
        self.per_layer = bool(per_layer)
        self.log_dir = log_dir
        self._writer = None
        self.records: list[dict] = []
        self._last_step = 0
        self._epoch = 0
        self._epoch_start = 0

    # -- callback hooks -----------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        opt = self._optimizer()
        if opt.diagnostics_every != self.every_n_steps or (opt.built and opt.diagnostics is None):
            with self.model.distribute_strategy.scope():
                opt.enable_diagnostics(self.every_n_steps)
            self.model.make_train_function(force=True)
        if self.log_dir and self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._epoch_start = len(self.records)

    def on_train_batch_end(self, batch, logs=None):
        self._poll()

    def on_epoch_end(self, epoch, logs=None):
        self._poll()
        if logs is None or not self.records:
            return
        chosen = self.records[self._epoch_start :] or self.records[-1:]
        keys = [k for k in chosen[-1] if k not in ("step", "epoch")]
        if not self.per_layer:
            keys = [k for k in keys if "/" not in k]
        for key in keys:
            values = [r[key] for r in chosen if key in r]
            logs[key] = float(np.mean(values))

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.flush()

    # -- reading the record ---------------------------------------------------------------------
    def _optimizer(self):
        opt = find_sparsified(self.model.optimizer)
        if opt is None:
            raise ValueError(
                "CompressionDiagnostics needs a model compiled with a SparsifiedOptimizer."
            )
        return opt

    def _poll(self) -> None:
        opt = self._optimizer()
        if opt.diagnostics is None:
            return
        step = int(opt.diagnostics_step.numpy())
        if step <= self._last_step:
            return
        self._last_step = step
        record = {"step": step, "epoch": self._epoch}
        record.update(
            summarize(opt.diagnostics.numpy(), opt.units, opt.diagnostics_names, per_unit=True)
        )
        self.records.append(record)
        if self._writer is not None:
            with self._writer.as_default(step=step):
                for key, value in record.items():
                    if key not in ("step", "epoch"):
                        write_scalar(f"diagnostics/{key}", value, step)

    @property
    def history(self) -> dict[str, list[float]]:
        """Every record as ``key -> list`` (missing values as NaN), ``step`` included."""
        keys: list[str] = []
        for r in self.records:
            keys += [k for k in r if k not in keys]
        return {k: [float(r.get(k, math.nan)) for r in self.records] for k in keys}


def plot_diagnostics(
    source: CompressionDiagnostics | Sequence[dict],
    path: str,
    layers: Iterable[str] | None = None,
    title: str | None = None,
) -> str:
    """Draw the records of a :class:`CompressionDiagnostics` (or a list of its records) to a
    PNG at ``path``: norm gap per layer and whole model against the worst case, empirical beta
    against its bound (unbiased quantizers), residual norm against gradient norm, density.
    Returns ``path``.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    records = source.records if isinstance(source, CompressionDiagnostics) else list(source)
    if not records:
        raise ValueError("plot_diagnostics needs at least one record.")
    steps = [r["step"] for r in records]
    names = sorted({k.split("/", 1)[1] for r in records for k in r if k.startswith("norm_gap/")})
    if layers is not None:
        wanted = set(layers)
        names = [n for n in names if n in wanted]

    def series(key):
        return [r.get(key, math.nan) for r in records]

    has_beta = any("beta" in r for r in records)
    panels = 4 if has_beta else 3
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    ax = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names):
        c = colors[i % len(colors)]
        ax.plot(steps, series(f"norm_gap/{name}"), color=c, lw=1, label=name)
        ax.plot(steps, series(f"norm_gap_bound/{name}"), color=c, lw=0.8, ls=":")
    ax.plot(steps, series("norm_gap"), color="k", lw=2, label="whole model")
    if any("grad_norm_gap" in r for r in records):
        ax.plot(steps, series("grad_norm_gap"), color="0.5", lw=1.5, label="fresh gradient only")
    ax.plot(steps, series("norm_gap_bound"), color="k", lw=1.2, ls="--", label="worst case")
    ax.set(xlabel="step", ylabel="||x - C(x)|| / ||x||", title="norm gap")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6)
    k = 1
    if has_beta:
        ax = axes[k]
        k += 1
        ax.plot(steps, series("beta"), color="k", lw=2, label="empirical beta")
        ax.plot(steps, series("beta_bound"), color="k", ls="--", label="variance_bound(d)")
        ax.set(xlabel="step", ylabel="beta", title="URQ beta")
        ax.legend(fontsize=6)
    ax = axes[k]
    ax.plot(steps, series("residual_norm"), label="residual norm")
    ax.plot(steps, series("grad_norm"), label="gradient norm")
    ax.set(xlabel="step", title="norms")
    ax.legend(fontsize=6)
    ax = axes[k + 1]
    ax.plot(steps, series("density"), label="sent (non-zero)")
    if any("wire_density" in r for r in records):
        ax.plot(steps, series("wire_density"), ls="--", label="promised")
    ax.set_yscale("log")
    ax.set(xlabel="step", title="density")
    ax.legend(fontsize=6)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
