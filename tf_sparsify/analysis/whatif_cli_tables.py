"""The text tables of ``python -m tf_sparsify whatif``: one prediction per method, and a sweep's
winners at powers of two."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tf_sparsify.step_model.predict import Prediction, winner


def columns(rows: Sequence[Sequence[str]], widths: Sequence[int], left: int = 0) -> list[str]:
    """``rows`` of cells as lines, the first ``left`` columns left-aligned, the others
    right-aligned; a column is ``widths``' width, or wider where a cell needs it, so that two
    cells are always at least two spaces apart."""
    fit = [max(width, 2 + max(len(row[i]) for row in rows)) for i, width in enumerate(widths)]
    return [
        "".join(
            cell.ljust(width) if i < left else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, fit, strict=True))
        )
        for row in rows
    ]


def table(predictions: Sequence[Prediction]) -> str:
    """A row per method: bytes one worker (a node's link, for hier-*) sends across nodes per
    step, comm and step ms, and the speed-up over dense."""
    dense = next((p.step for p in predictions if p.method == "dense"), None)
    rows = [("method", "inter-node bytes", "comm ms", "step ms", "x dense")]
    for p in predictions:
        speedup = f"{dense / p.step:.2f}" if dense and p.step else "-"
        rows.append(
            (
                p.method,
                f"{p.bytes_sent:,.0f}",
                f"{1e3 * p.comm:.1f}",
                f"{1e3 * p.step:.1f}",
                speedup,
            )
        )
    head, *body = columns(rows, (16, 19, 11, 11, 9), left=1)
    best = winner(predictions)
    lines = [head, "-" * len(head), *body]
    lines.append(f"winner: {best.method} ({1e3 * best.step:.1f} ms/step)")
    return "\n".join(lines)


def sweep_table(names: Sequence[str], bandwidths: Sequence[float], results: dict) -> str:
    """At powers of two, a column per bandwidth: the winner, its ms/step and dense's."""
    powers = [p for p in results[bandwidths[0]] if p & (p - 1) == 0]
    rows = [["P", *(f"{n}: winner ms (dense ms)" for n in names)]]
    for p in powers:
        cells = [str(p)]
        for bandwidth in bandwidths:
            predictions = results[bandwidth][p]
            best = winner(predictions)
            dense = next((x.step for x in predictions if x.method == "dense"), math.nan)
            cells.append(f"{best.method} {1e3 * best.step:.0f} ({1e3 * dense:.0f})")
        rows.append(cells)
    return "\n".join(columns(rows, (6, *(34 for _ in names))))
