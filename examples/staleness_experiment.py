"""Step sizes for delayed, compressed gradients, and bits to a target accuracy (real data).

    python examples/staleness_experiment.py                      # about a minute on 2 cores
    python examples/staleness_experiment.py --problem logistic --out-dir /tmp/staleness

Problem: ridge least squares (or l2-regularized logistic regression) on scikit-learn's bundled
breast-cancer data (568 rows, 30 standardized features + intercept), split into P = 4 equal
shards; worker p holds ``f_p`` and ``f = mean_p f_p``. Every run is
:class:`tf_sparsify.distribute.ServerOptimizer` on P simulated workers with full local gradients
(SGD on float64 weights); ``L`` comes from
:func:`tf_sparsify.analysis.theory.smoothness_least_squares` (the data matrix's largest
singular value) and ``f*`` from a direct solve (Newton for logistic).

(a) Delays: fixed tau in {0, 2, 8}, random delays in [0, 8] and cyclic IAG (staleness P - 1),
    dense gradients, at 1, 2, 4 and 8 times the bound ``max_step_size(L, tau)``.
(b) Compressors, synchronous: dense, rand-k (k/d = 1/2, 1/4, 1/8), QSGD (s = 1, 2, 4, 16) and
    TernGrad; for each the best step of ``(1/L) * 2^-j``, j = 0..4 (unbiased quantizers need
    smaller steps as beta grows): iterations and total bits sent by all workers (the payload
    bytes of tf_sparsify's wire format) until ``(f - f*) / (f(0) - f*) <= target``.
Writes ``staleness.md`` (both tables) and ``staleness.png`` under ``--out-dir``.

Least squares shows the bound at work: every delay model converges at it, fixed delays diverge
at 4x (the bound is sufficient, 2x to 2.5x below the exact limit of a fixed delay), random
delays (mean tau/2) and IAG (entries of ages 0..P-1) tolerate 4x and diverge at 8x. For logistic
regression ``L`` uses sigmoid' <= 1/4, which holds with equality only at margin 0: near the
optimum the curvature is far lower and even 8x the bound converges.

In (b), tf_sparsify's rand-k draws the same indices on every worker, so its error is relative to
the aggregated gradient, which vanishes at the optimum: it keeps the step 1/L. QSGD and TernGrad
draw independent noise per worker on gradients ``grad f_p(x*) != 0``, which leaves a noise floor
proportional to the step: larger beta needs smaller steps to reach the target. QSGD's payload is
one int8 per entry for any s <= 127 (plus a float32 norm), so its bits do not fall with s.
"""

from __future__ import annotations

import argparse
import os
import time

# TensorFlow's C++ log lines off unless the user asked for them.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_sparsify as tfs  # noqa: E402
from tf_sparsify import theory  # noqa: E402
from tf_sparsify.distribute import IAG, DelayedGradients, ServerOptimizer  # noqa: E402

CHUNK = 100  # steps per compiled loop
FACTORS = (1, 2, 4, 8)  # step sizes in (a), as multiples of the bound


class Problem:
    """``f = mean_p f_p`` on equal shards, in float64; ``grads(w)`` stacks the workers'."""

    def __init__(self, kind: str, workers: int, l2: float):
        from sklearn.datasets import load_breast_cancer

        x, y = load_breast_cancer(return_X_y=True)
        x = (x - x.mean(0)) / x.std(0)
        x = np.hstack([x, np.ones((len(x), 1))])
        rows = len(x) // workers * workers
        x, y = x[:rows], 2.0 * y[:rows] - 1.0
        self.kind, self.l2, self.dim = kind, l2, x.shape[1]
        self.x, self.y = x, y
        order = np.argsort(np.arange(rows) % workers, kind="stable")  # shard p: rows p::P
        self.xs = tf.constant(x[order].reshape(workers, -1, self.dim))
        self.ys = tf.constant(y[order].reshape(workers, -1))
        if kind == "least_squares":
            self.L = theory.smoothness_least_squares(x, l2)
            self.w_star = np.linalg.solve(x.T @ x / rows + l2 * np.eye(self.dim), x.T @ y / rows)
        else:
            self.L = theory.smoothness_logistic(x, l2)
            self.w_star = self._newton()
        self.f_star = self.loss_np(self.w_star)
        self.f_zero = self.loss_np(np.zeros(self.dim))

    def loss_np(self, w: np.ndarray) -> float:
        margin = self.x @ w
        if self.kind == "least_squares":
            data = 0.5 * np.mean((margin - self.y) ** 2)
        else:
            data = np.mean(np.logaddexp(0.0, -self.y * margin))
        return float(data + 0.5 * self.l2 * w @ w)

    def _newton(self) -> np.ndarray:
        w, n = np.zeros(self.dim), len(self.x)
        for _ in range(50):
            s = 1.0 / (1.0 + np.exp(self.y * (self.x @ w)))  # sigmoid(-y x.w)
            grad = -self.x.T @ (self.y * s) / n + self.l2 * w
            hess = self.x.T @ (self.x * (s * (1 - s))[:, None]) / n + self.l2 * np.eye(self.dim)
            w = w - np.linalg.solve(hess, grad)
        return w

    def loss(self, w: tf.Tensor) -> tf.Tensor:
        margin = tf.einsum("pnd,d->pn", self.xs, w)
        if self.kind == "least_squares":
            data = 0.5 * tf.reduce_mean((margin - self.ys) ** 2)
        else:
            data = tf.reduce_mean(tf.math.softplus(-self.ys * margin))
        return data + 0.5 * self.l2 * tf.reduce_sum(w * w)

    def grads(self, w: tf.Tensor) -> tf.Tensor:
        """``[P, d]``: each worker's gradient of its own ``f_p``."""
        margin = tf.einsum("pnd,d->pn", self.xs, w)
        if self.kind == "least_squares":
            residual = margin - self.ys
        else:
            residual = -self.ys * tf.sigmoid(-self.ys * margin)
        rows = tf.cast(tf.shape(self.xs)[1], tf.float64)
        return tf.einsum("pnd,pn->pd", self.xs, residual) / rows + self.l2 * w


class Runner:
    """One ServerOptimizer (traced once), reset and rerun for each step size."""

    def __init__(self, problem: Problem, compressor, server, workers: int):
        self.problem = problem
        self.w = keras.Variable(np.zeros(problem.dim), dtype="float64")
        self.opt = ServerOptimizer(keras.optimizers.SGD(1.0), compressor, server, workers=workers)
        self.opt.build([self.w])
        self.bits_per_step = 8 * workers * self.opt.wire_bytes_per_step

    @tf.function
    def _chunk(self) -> tf.Tensor:
        losses = tf.TensorArray(tf.float64, size=CHUNK)
        for i in tf.range(CHUNK):
            self.opt.apply([self.problem.grads(self.w.value)], [self.w])
            losses = losses.write(i, self.problem.loss(self.w.value))
        return losses.stack()

    def run(self, gamma: float, steps: int, target: float | None = None) -> np.ndarray:
        """Relative suboptimality after each step (stops early below ``target``, or on NaN)."""
        for v in [self.w, *self.opt.variables]:
            v.assign(tf.zeros(v.shape, v.dtype))
        self.opt.learning_rate.assign(gamma)
        p, curve = self.problem, []
        while len(curve) < steps:
            chunk = (self._chunk().numpy() - p.f_star) / (p.f_zero - p.f_star)
            curve.extend(chunk)
            if not np.isfinite(chunk[-1]) or chunk[-1] > 1e12:
                break
            if target is not None and chunk.min() <= target:
                break
        return np.array(curve[:steps])


def status(curve: np.ndarray, steps: int) -> str:
    """How a run of ``steps`` iterations ended, judged on its last fifth."""
    if len(curve) < steps or not np.isfinite(curve[-1]) or curve[-1] > 10:
        return "diverges"
    if curve[-1] < 1e-8:
        return "converged"
    tail = curve[-steps // 5 :]
    if tail[-1] < 0.5 * tail[0]:
        return "converging"
    return "no decay"


def _floor(value: float) -> float | str:
    """Suboptimalities below float64 resolution print as such."""
    return "< 1e-14" if abs(value) < 1e-14 else float(value)


def delays_experiment(problem: Problem, args) -> tuple[list[dict], dict]:
    w = args.workers
    servers = [
        ("fixed tau=0", DelayedGradients(0), 0),
        ("fixed tau=2", DelayedGradients(2), 2),
        ("fixed tau=8", DelayedGradients(8), 8),
        ("random tau<=8", DelayedGradients(8, model="random", seed=1), 8),
        (f"IAG cyclic (tau={w - 1})", IAG("cyclic"), IAG("cyclic").staleness(w)),
    ]
    rows, curves = [], {}
    for name, server, tau in servers:
        runner = Runner(problem, tfs.Identity(), server, w)
        bound = theory.max_step_size(problem.L, tau)
        for factor in FACTORS:
            curve = runner.run(factor * bound, args.steps)
            hit = np.flatnonzero(curve <= 1e-6)
            rows.append(
                {
                    "server": name,
                    "step / bound": factor,
                    "step * L": factor * bound * problem.L,
                    "iterations to 1e-6": int(hit[0]) + 1 if hit.size else "-",
                    "final rel. subopt.": _floor(curve[-1]) if len(curve) == args.steps else "inf",
                    "behaviour": status(curve, args.steps),
                }
            )
            curves[(name, factor)] = curve
    return rows, curves


def compressors_experiment(problem: Problem, args) -> tuple[list[dict], dict]:
    d = problem.dim
    compressors = [("dense", tfs.Identity())]
    compressors += [(f"rand-k k={-(-d // f)}", tfs.RandomK(1 / f, seed=1)) for f in (2, 4, 8)]
    compressors += [(f"QSGD s={s}", tfs.QSGD(levels=s, seed=2)) for s in (1, 2, 4, 16)]
    compressors += [("ternary", tfs.TernGrad(seed=3))]
    rows, curves = [], {}
    for name, compressor in compressors:
        runner = Runner(problem, compressor, DelayedGradients(0), args.workers)
        best = None
        for j in range(5):
            gamma = 2.0**-j / problem.L
            curve = runner.run(gamma, args.max_steps, target=args.target)
            hit = np.flatnonzero(curve <= args.target)
            if hit.size and (best is None or hit[0] < best[0]):
                best = (hit[0] + 1, j, curve)
        beta = theory.variance_bound(compressor, d)
        row = {"compressor": name, "beta": beta, "bits/step": runner.bits_per_step}
        if best is None:
            row.update({"best step * L": "-", "iterations": "not reached", "Mbit to target": "-"})
        else:
            iters, j, curve = best
            row.update(
                {
                    "best step * L": 2.0**-j,
                    "iterations": int(iters),
                    "Mbit to target": iters * runner.bits_per_step / 1e6,
                }
            )
            curves[name] = (curve[:iters], runner.bits_per_step)
        rows.append(row)
    return rows, curves


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])

    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def plot(delay_curves: dict, compressor_curves: dict, target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {}
    for (name, factor), curve in delay_curves.items():
        if factor not in (1, 4):
            continue
        color = colors.setdefault(name, f"C{len(colors)}")
        style = "-" if factor == 1 else ":"
        left.semilogy(np.clip(curve, 1e-16, 1e6), style, color=color, label=f"{name}, {factor}x")
    left.set(xlabel="iteration", ylabel="(f - f*) / (f(0) - f*)", ylim=(1e-14, 1e6))
    left.set_title("(a) at the bound (solid) and 4x above it (dotted)")
    left.legend(fontsize=7)
    for name, (curve, bits) in compressor_curves.items():
        right.loglog(bits * np.arange(1, len(curve) + 1), np.maximum(curve, 1e-16), label=name)
    right.axhline(target, color="k", lw=0.5)
    right.set(xlabel="bits sent by all workers", ylabel="(f - f*) / (f(0) - f*)")
    right.set_title("(b) best step per compressor, synchronous")
    if compressor_curves:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problem", choices=("least_squares", "logistic"), default="least_squares")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--l2", type=float, default=0.5, help="ridge / l2 regularization")
    p.add_argument("--steps", type=int, default=3000, help="iterations per run in (a)")
    p.add_argument("--max-steps", type=int, default=3000, help="iteration cap per run in (b)")
    p.add_argument("--target", type=float, default=1e-4, help="relative suboptimality in (b)")
    p.add_argument("--out-dir", default="outputs", help="where staleness.md/.png go")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.time()
    problem = Problem(args.problem, args.workers, args.l2)
    header = (
        f"{args.problem}, breast cancer {problem.x.shape}, P={args.workers}, l2={args.l2}: "
        f"L={problem.L:.4g}, f*={problem.f_star:.6g}"
    )
    print(header)
    delay_rows, delay_curves = delays_experiment(problem, args)
    table_a = markdown(delay_rows)
    print("\n(a) delays, dense gradients\n" + table_a)
    comp_rows, comp_curves = compressors_experiment(problem, args)
    table_b = markdown(comp_rows)
    print(f"\n(b) compressors, target {args.target:g}\n" + table_b)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "staleness.md"), "w") as f:
        f.write(f"{header}\n\n(a) delays, dense gradients\n\n{table_a}\n\n")
        f.write(f"(b) compressors, target {args.target:g}\n\n{table_b}\n")
    plot(delay_curves, comp_curves, args.target, os.path.join(args.out_dir, "staleness.png"))
    print(f"\nwrote {args.out_dir}/staleness.md and .png in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
