"""tf_sparsify.analysis.theory: the delayed step-size bound, quantizer variances, smoothness
estimates."""

from __future__ import annotations

import importlib.util
import math
import os

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_breast_cancer

import tf_sparsify as tfs
from tf_sparsify.analysis import theory


def _delayed_gd(hessian: np.ndarray, gamma: float, tau: int, steps: int) -> float:
    """``||x_K||`` of ``x_{k+1} = x_k - gamma H x_{k - tau}`` (minimum at 0) from ones;
    stops early (returning the norm) once it exceeds 1e6."""
    xs = [np.ones(len(hessian))]
    for k in range(steps):
        stale = xs[k - tau] if k >= tau else xs[0]
        xs.append(xs[-1] - gamma * hessian @ stale)
        if np.linalg.norm(xs[-1]) > 1e6:
            break
    return float(np.linalg.norm(xs[-1]))


def test_max_step_size_formula():
    assert theory.max_step_size(4.0, 0) == pytest.approx(0.25)  # 1/L
    assert theory.max_step_size(2.0, 1) == pytest.approx(2 / (2 * (1 + math.sqrt(17))))
    assert theory.max_step_size(1.0, 2) == pytest.approx(0.25)  # sqrt(49) = 7
    steps = [theory.max_step_size(1.0, tau) for tau in range(10)]
    assert all(a > b for a, b in zip(steps, steps[1:], strict=False))


@pytest.mark.parametrize("tau", [0, 2, 8])
def test_step_at_the_bound_converges_and_far_above_it_diverges(tau):
    hessian = np.diag([1.0, 0.5, 0.2])  # L = 1
    gamma = theory.max_step_size(1.0, tau)
    assert _delayed_gd(hessian, gamma, tau, 1500) < 1e-6
    assert _delayed_gd(hessian, 3 * gamma, tau, 1500) > 1e3


@pytest.mark.parametrize(
    "args, match",
    [((1.0, -1), "tau.*-1"), ((1.0, 2.5), "tau.*2.5"), ((0.0, 1), "L.*0.0"), ((-1, 1), "L.*-1")],
)
def test_max_step_size_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        theory.max_step_size(*args)


def test_variance_bounds_are_the_papers_formulas():
    d = 400
    assert theory.variance_bound(tfs.RandomK(ratio=0.1), d) == pytest.approx(d / 40 - 1)
    assert theory.variance_bound(tfs.QSGD(levels=4), d) == pytest.approx(min(d / 16, 20 / 4))
    assert theory.variance_bound(tfs.QSGD(levels=32), d) == pytest.approx(d / 32**2)
    assert theory.variance_bound(tfs.QSGD(levels=2, bucket_size=64), d) == pytest.approx(4.0)
    assert theory.variance_bound(tfs.TernGrad(), d) == pytest.approx(19.0)
    assert theory.variance_bound(tfs.Identity(), d) == 0.0
    for biased in (tfs.TopK(k=3), tfs.ScaledSign(), tfs.FP16()):
        with pytest.raises(ValueError, match="compressor"):
            theory.variance_bound(biased, d)
    with pytest.raises(ValueError, match="num_elements.*0"):
        theory.variance_bound(tfs.TernGrad(), 0)


@pytest.mark.parametrize(
    "compressor", [tfs.RandomK(ratio=0.25), tfs.QSGD(levels=2), tfs.TernGrad()], ids=repr
)
def test_empirical_variance_is_within_the_bound(compressor):
    d, draws = 64, 300
    v = tf.constant(np.random.default_rng(0).standard_t(3, size=d).astype("float32"))
    errors = []
    for step in range(draws):
        payload, ctx = compressor.compress(v, step, 0, 0)
        errors.append(float(tf.reduce_sum(tf.square(compressor.decompress(payload, ctx) - v))))
    ratio = np.mean(errors) / float(tf.reduce_sum(tf.square(v)))
    beta = theory.variance_bound(compressor, d)
    assert 0 < ratio <= 1.1 * beta  # 10%: the sampling error of 300 draws
    if isinstance(compressor, tfs.RandomK):  # tight: E||Q(v) - v||^2 = (d/k - 1) ||v||^2
        assert ratio == pytest.approx(beta, rel=0.1)
    if isinstance(compressor, tfs.TernGrad):  # the exact data-dependent beta
        assert ratio == pytest.approx(theory.ternary_variance(v.numpy()), rel=0.15)
        assert theory.ternary_variance(v.numpy()) <= math.sqrt(d) - 1


def test_ternary_variance_extremes():
    assert theory.ternary_variance(np.zeros(5)) == 0.0
    assert theory.ternary_variance(np.ones(9)) == pytest.approx(0.0)  # all at the max: exact
    assert theory.ternary_variance([3.0, 0, 0]) == pytest.approx(0.0)


def test_largest_eigenvalue_and_smoothness_on_real_data():
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    n = len(x)
    top = np.linalg.eigvalsh(x.T @ x)[-1]
    assert theory.largest_eigenvalue(x) == pytest.approx(top, rel=1e-8)
    assert theory.smoothness_least_squares(x, l2=0.5) == pytest.approx(top / n + 0.5, rel=1e-8)
    L = theory.smoothness_logistic(x)
    assert L == pytest.approx(top / (4 * n), rel=1e-8)
    # the logistic Hessian X^T D X / n, D = s(1 - s) <= 1/4, attains L at w = 0 only
    w = np.random.default_rng(0).normal(size=x.shape[1]) * 0.3
    s = 1 / (1 + np.exp(-(x @ w)))
    hessian = x.T @ (x * (s * (1 - s))[:, None]) / n
    assert np.linalg.eigvalsh(hessian)[-1] < L


def test_largest_eigenvalue_is_the_squared_two_norm():
    """Exact where the power iteration it replaced needed many steps: two nearly equal top
    singular values, a zero matrix, one row; its old arguments still work, with a warning."""
    x = np.diag([1.0, 1.0 - 1e-9, 0.5]) @ np.random.default_rng(1).normal(size=(3, 3))
    top = np.linalg.eigvalsh(x.T @ x)[-1]
    assert theory.largest_eigenvalue(x) == pytest.approx(top, rel=1e-12)
    assert theory.largest_eigenvalue(np.zeros((4, 3))) == 0.0
    assert theory.largest_eigenvalue([[3.0, 4.0]]) == pytest.approx(25.0)
    with pytest.warns(DeprecationWarning, match="iterations"):
        assert theory.largest_eigenvalue(x, iterations=10, seed=1) == pytest.approx(top)


@pytest.mark.parametrize("bad", [np.zeros(3), np.zeros((0, 2)), np.array([[1.0, np.nan]])])
def test_smoothness_rejects_bad_data(bad):
    with pytest.raises(ValueError, match="X"):
        theory.smoothness_least_squares(bad)
    with pytest.raises(ValueError, match="l2.*-1"):
        theory.smoothness_logistic(np.ones((2, 2)), l2=-1)


@pytest.mark.example
def test_staleness_experiment_shows_the_bound_on_real_data(tmp_path):
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples")
    spec = importlib.util.spec_from_file_location(
        "staleness_experiment", os.path.join(path, "staleness_experiment.py")
    )
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    args = ex.parse_args(["--steps", "400", "--max-steps", "200", "--out-dir", str(tmp_path)])
    problem = ex.Problem("least_squares", args.workers, args.l2)
    assert problem.L == pytest.approx(theory.smoothness_least_squares(problem.x, args.l2))
    rows, curves = ex.delays_experiment(problem, args)
    behaviour = {(r["server"], r["step / bound"]): r["behaviour"] for r in rows}
    for tau in (0, 2, 8):
        assert behaviour[(f"fixed tau={tau}", 1)] in ("converged", "converging")
        assert behaviour[(f"fixed tau={tau}", 4)] == "diverges"
    assert "| fixed tau=8 | 1 |" in ex.markdown(rows)
    ex.plot(curves, {}, args.target, str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").stat().st_size > 10_000
