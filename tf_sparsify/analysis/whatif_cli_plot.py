"""The plot of ``python -m tf_sparsify whatif --sweep``: ms/step against P (a PNG)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from tf_sparsify.step_model.predict import winner_ranges


def plot_sweep(names: Sequence[str], bandwidths: Sequence[float], results: dict, path: str) -> None:
    """ms/step against P, a line per method, a panel per bandwidth (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4.2), squeeze=False)
    for ax, name, bandwidth in zip(axes[0], names, bandwidths, strict=True):
        by_p = results[bandwidth]
        ps = sorted(by_p)
        for i, method in enumerate(pred.method for pred in by_p[ps[0]]):
            ax.plot(ps, [1e3 * by_p[p][i].step for p in ps], label=method)
        wins = ", ".join(f"{m} {a}-{b}" for a, b, m in winner_ranges(by_p))
        ax.set_title(f"{name}, fastest: {wins}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers P")
        ax.set_ylabel("predicted ms/step")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
