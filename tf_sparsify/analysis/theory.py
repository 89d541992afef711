"""The step-size theory of compressed, delayed gradients (Khirirat, Feyzmahdavian, Johansson 2018).

- :func:`max_step_size`: the admissible step size under bounded staleness ``tau``.
- :func:`variance_bound`, :func:`ternary_variance`: the compression accuracy ``beta`` of an
  unbiased random quantizer, ``E||Q(v) - v||^2 <= beta ||v||^2``.
- :func:`smoothness_least_squares`, :func:`smoothness_logistic`: the smoothness constant ``L`` of
  the two classic objectives on a data matrix, from its largest singular value (the matrix
  2-norm).
- the network what-if of :mod:`tf_sparsify.analysis.whatif` (alpha-beta step-time models of each
  exchange method: :func:`predict`, :func:`sweep`, :func:`crossover_workers`, ...): its names
  (``whatif.__all__``) are re-exported here.

Objectives, for a data matrix ``X`` of ``n`` rows (a row per sample):
``least squares  f(w) = ||X w - y||^2 / (2 n) + l2 ||w||^2 / 2`` and
``logistic       f(w) = mean_i log(1 + exp(-y_i x_i^T w)) + l2 ||w||^2 / 2``, ``y_i = +-1``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from tf_sparsify.analysis import whatif
from tf_sparsify.analysis.whatif import *  # noqa: F403 (the what-if's names, re-exported)
from tf_sparsify.common.checks import check_int, check_number
from tf_sparsify.compressors.base import Compressor

__all__ = [
    "largest_eigenvalue",
    "max_step_size",
    "smoothness_least_squares",
    "smoothness_logistic",
    "ternary_variance",
    "variance_bound",
    *whatif.__all__,
]


def max_step_size(L: float, tau: int) -> float:
    """``2 / (L (1 + sqrt(1 + 8 tau (tau + 1))))``: steps below it converge with delays <= tau.

    ``tau = 0`` gives ``1 / L``. The bound is sufficient, not tight: on a quadratic, gradient
    descent with a fixed delay ``tau`` is stable up to ``2 sin(pi / (2 (2 tau + 1))) / L``,
    2.2 to 2.6 times larger for ``tau >= 1`` (and ``2 / L`` for ``tau = 0``).
    """
    L = check_number("L", L, low=0, low_open=True)
    tau = check_int("tau", tau, minimum=0)
    return 2.0 / (L * (1.0 + math.sqrt(1.0 + 8.0 * tau * (tau + 1))))


def variance_bound(compressor: Compressor, num_elements: int) -> float:
    """``beta`` of an unbiased quantizer on a tensor of ``num_elements`` entries.

    RandomK: ``d/k - 1``; QSGD with ``s`` levels and buckets of ``b``: ``min(b/s^2, sqrt(b)/s)``;
    TernGrad: ``sqrt(d) - 1``; Identity: 0. Biased compressors (TopK, ScaledSign, FP16) are
    not URQs: ValueError.
    """
    if not isinstance(compressor, Compressor) or not compressor.unbiased:
        raise ValueError(
            "`compressor` must be an unbiased tf_sparsify compressor (a URQ); "
            f"received compressor={compressor!r}"
        )
    return float(compressor.variance_bound(check_int("num_elements", num_elements)))


def ternary_variance(v) -> float:
    """TernGrad's exact ``beta`` on ``v``: ``||v||_inf ||v||_1 / ||v||^2 - 1`` (<= sqrt(d) - 1)."""
    v = np.asarray(v, dtype=np.float64).ravel()
    sq = float(v @ v)
    if sq == 0:
        return 0.0
    return float(np.abs(v).max() * np.abs(v).sum() / sq - 1.0)


def largest_eigenvalue(X, iterations=None, tol=None, seed=None) -> float:
    """The largest eigenvalue of ``X^T X``: the square of ``X``'s largest singular value
    (``np.linalg.norm(X, 2)``, from an SVD: exact to rounding).

    ``iterations``, ``tol`` and ``seed`` set the power iteration this used to run; they have no
    effect now and are deprecated.
    """
    if (iterations, tol, seed) != (None, None, None):
        warnings.warn(
            "largest_eigenvalue: `iterations`, `tol` and `seed` have no effect (the eigenvalue "
            "comes from the matrix 2-norm) and will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2 or X.size == 0 or not np.isfinite(X).all():
        raise ValueError(
            f"`X` must be a non-empty, finite 2-D data matrix; received shape={X.shape}"
        )
    return float(np.linalg.norm(X, 2)) ** 2


def smoothness_least_squares(X, l2: float = 0.0) -> float:
    """``L = lambda_max(X^T X) / n + l2`` of the mean least-squares objective."""
    X = np.asarray(X, dtype=np.float64)
    return largest_eigenvalue(X) / X.shape[0] + check_number("l2", l2, low=0)


def smoothness_logistic(X, l2: float = 0.0) -> float:
    """``L = lambda_max(X^T X) / (4 n) + l2`` of the mean logistic loss (sigmoid' <= 1/4)."""
    X = np.asarray(X, dtype=np.float64)
    return largest_eigenvalue(X) / (4.0 * X.shape[0]) + check_number("l2", l2, low=0)
