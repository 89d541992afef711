"""What the papers measure, computed on the real gradients inside the step.

Per message (unit) of one step and replica, :func:`unit_stats` records five numbers:

* ``grad_sq``: ``||g||^2`` of the fresh gradient (after local clipping, before momentum);
* ``input_sq``: ``||x||^2`` of what was compressed (``x = residual + g`` with error feedback);
* ``error_sq``: ``||x - C(x)||^2`` (with error feedback this is the new residual's norm);
* ``sent``: the number of non-zero entries of ``C(x)``;
* ``grad_error_sq``: ``||g - C(g)||^2``, the same compressor applied to the fresh gradient
  alone (what the gap would be without the accumulated residual).

:func:`summarize` turns them into the papers' quantities: the norm gap ``||x - C(x)|| / ||x||``
against its worst case ``sqrt(1 - K/n)`` (TopK, paper A), the empirical ``beta =
||Q(v) - v||^2 / ||v||^2`` of an unbiased quantizer against ``variance_bound(d)`` (paper B), the
residual norm and the density actually sent, per unit and for the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_sparsify.compressors.base import Codec, Compressor
from tf_sparsify.core.plan import Unit, planned
from tf_sparsify.core.routes.route import Message

STAT_NAMES = ("grad_sq", "input_sq", "error_sq", "sent", "grad_error_sq")


def unit_stats(
    grad: tf.Tensor, x: tf.Tensor, error: tf.Tensor, grad_error: tf.Tensor | None = None
) -> tf.Tensor:
    """``[grad_sq, input_sq, error_sq, sent, grad_error_sq]`` as float64 (see the module
    docstring); without ``grad_error`` the last entry repeats ``error_sq``."""

    def sq(t):
        return tf.cast(tf.reduce_sum(tf.square(tf.cast(t, tf.float32))), tf.float64)

    sent = tf.math.count_nonzero(tf.not_equal(x - error, 0), dtype=tf.int64)
    error_sq = sq(error)
    grad_error_sq = error_sq if grad_error is None else sq(grad_error)
    return tf.stack([sq(grad), sq(x), error_sq, tf.cast(sent, tf.float64), grad_error_sq])


def measure_step(
    units: Sequence[Unit],
    messages: Sequence[Message],
    flag: tf.Tensor | bool,
    iteration: tf.Tensor,
    replica_id: tf.Tensor,
) -> tf.Tensor:
    """``[len(units), 5]`` stats rows of this replica, computed only when ``flag`` is True
    (zeros otherwise; zeros too for a unit none of whose variables had a gradient)."""
    width = len(STAT_NAMES)
    by_unit = {planned(units, m.unit).indices: m for m in messages}

    def compute() -> tf.Tensor:
        rows = []
        for unit in units:
            m = by_unit.get(unit.indices)
            rows.append(
                tf.zeros([width], tf.float64) if m is None else _stats(m, iteration, replica_id)
            )
        return tf.stack(rows) if rows else tf.zeros([0, width], tf.float64)

    def skip() -> tf.Tensor:
        return tf.zeros([len(units), width], tf.float64)

    return tf.cond(tf.convert_to_tensor(flag, tf.bool), compute, skip)


def _stats(m: Message, iteration: tf.Tensor, replica_id: tf.Tensor) -> tf.Tensor:
    """One message's :func:`unit_stats` (it went the dense route: measured steps keep every
    unit's joined gradient)."""
    compressor = m.unit.compressor
    acc = m.x if m.before.residual is None else m.x + m.before.residual
    error = m.after.residual
    if not isinstance(compressor, Codec):  # no local payload: the residual only
        error = tf.zeros_like(acc) if error is None else error
        return unit_stats(m.grad, acc, error, tf.zeros_like(m.grad))
    if error is None:
        error = acc - compressor.decompress(m.payload, m.ctx)
    if compressor.is_identity:
        grad_error = tf.zeros_like(m.grad)
    else:  # the same compressor on the fresh gradient alone
        fresh, fresh_ctx = compressor.compress(m.grad, iteration, m.unit.indices[0], replica_id)
        grad_error = m.grad - compressor.decompress(fresh, fresh_ctx)
    return unit_stats(m.grad, acc, error, grad_error)


def gap_bound(compressor: Compressor, num_elements: int) -> float | None:
    """Worst case of ``||x - C(x)|| / ||x||``: ``sqrt(1 - contraction)`` for a contraction
    (TopK: ``sqrt(1 - K/n)``), ``sqrt(beta)`` (root mean square) for an unbiased quantizer,
    ``None`` when the compressor promises neither.
    """
    delta = compressor.contraction(num_elements)
    if delta is not None:
        return math.sqrt(max(0.0, 1.0 - delta))
    beta = beta_bound(compressor, num_elements)
    return None if beta is None else math.sqrt(beta)


def beta_bound(compressor: Compressor, num_elements: int) -> float | None:
    """``variance_bound(d)`` of an unbiased quantizer, else ``None``."""
    beta = compressor.variance_bound(num_elements) if compressor.unbiased else None
    return None if beta is None else float(beta)


def _ratio(num: float, den: float) -> float:
    return math.sqrt(num / den) if den > 0 else 0.0


def summarize(
    stats: np.ndarray,
    units: Sequence,
    names: Sequence[str] | None = None,
    per_unit: bool = True,
) -> dict[str, float]:
    """The papers' quantities from a ``[len(units), 5]`` array of :func:`unit_stats` rows.

    Whole-model keys: ``norm_gap`` (``sqrt(sum error_sq / sum input_sq)`` over every unit),
    ``grad_norm_gap`` (the same for the compressor applied to the fresh gradient alone),
    ``norm_gap_bound`` (``sqrt(max_u bound_u**2)``, a valid worst case for the whole vector;
    absent when some unit has no bound), ``residual_norm`` (over units with error feedback),
    ``grad_norm``, ``density`` (entries sent / entries), ``wire_density`` (the compressors'
    promised entries, when they say), and ``beta`` / ``beta_bound`` when every compressed unit
    is an unbiased quantizer. With ``per_unit``, the same keys suffixed ``/<name>`` per unit.
    """
    stats = np.asarray(stats, dtype=np.float64).reshape(len(units), len(STAT_NAMES))
    names = list(names) if names is not None else [f"unit{i}" for i in range(len(units))]
    out: dict[str, float] = {}
    bounds, betas_ok = [], True
    total = dict.fromkeys(("grad_sq", "input_sq", "error_sq", "sent", "res_sq", "g_err_sq"), 0.0)
    elements = 0
    for unit, name, row in zip(units, names, stats, strict=True):
        g_sq, x_sq, e_sq, sent, g_err_sq = (float(v) for v in row)
        n = unit.num_elements
        elements += n
        for key, value in (("grad_sq", g_sq), ("input_sq", x_sq), ("error_sq", e_sq)):
            total[key] += value
        total["sent"] += sent
        total["g_err_sq"] += g_err_sq
        if unit.error_feedback:
            total["res_sq"] += e_sq
        bound = gap_bound(unit.compressor, n)
        bounds.append(bound)
        b_bound = beta_bound(unit.compressor, n)
        compressed = not unit.compressor.is_identity
        if compressed and b_bound is None:
            betas_ok = False
        if per_unit:
            out[f"norm_gap/{name}"] = _ratio(e_sq, x_sq)
            out[f"grad_norm_gap/{name}"] = _ratio(g_err_sq, g_sq)
            if bound is not None:
                out[f"norm_gap_bound/{name}"] = bound
            if b_bound is not None and compressed:
                out[f"beta/{name}"] = e_sq / x_sq if x_sq > 0 else 0.0
                out[f"beta_bound/{name}"] = b_bound
            if unit.error_feedback:
                out[f"residual_norm/{name}"] = math.sqrt(e_sq)
            out[f"density/{name}"] = sent / n
    out["norm_gap"] = _ratio(total["error_sq"], total["input_sq"])
    out["grad_norm_gap"] = _ratio(total["g_err_sq"], total["grad_sq"])
    if bounds and all(b is not None for b in bounds):
        out["norm_gap_bound"] = math.sqrt(max(b * b for b in bounds))
    out["residual_norm"] = math.sqrt(total["res_sq"])
    out["grad_norm"] = math.sqrt(total["grad_sq"])
    out["density"] = total["sent"] / max(elements, 1)
    promised = [u.compressor.entries_sent(u.num_elements) for u in units]
    if all(p is not None for p in promised):
        out["wire_density"] = sum(promised) / max(elements, 1)
    if betas_ok and any(not u.compressor.is_identity for u in units):
        out["beta"] = total["error_sq"] / total["input_sq"] if total["input_sq"] > 0 else 0.0
        out["beta_bound"] = max(beta_bound(u.compressor, u.num_elements) for u in units)
    return out
