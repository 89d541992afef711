"""Tables (markdown + JSON) and the time-to-target plot, from the records rank 0 wrote."""

from __future__ import annotations

import json
import os
import textwrap
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from benchmarks.network.models import COMPRESSORS, EXCHANGE_ONLY, LATE, PROBES

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from benchmarks.network.tasks import Task

DENSE, FP16 = "identity", "fp16"


def _label(compressor: str) -> str:
    return COMPRESSORS[compressor]


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _best_ms(rows: list[dict]) -> dict[tuple[str, str, str, str], float]:
    """Best ms/step by (backend, model, rate, compressor)."""
    return {(r["backend"], r["model"], r["rate"], r["compressor"]): r["best_ms"] for r in rows}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row plus ``x_dense`` (dense ms / its ms: > 1 is faster than dense) and ``x_fp16``,
    both against rows of the same job (backend, model, rate); None when that row is missing."""
    best = _best_ms(rows)
    out = []
    for row in rows:
        job = (row["backend"], row["model"], row["rate"])
        ratios = {}
        for key, reference in (("x_dense", DENSE), ("x_fp16", FP16)):
            ms = best.get((*job, reference))
            ratios[key] = None if ms is None else ms / row["best_ms"]
        out.append({**row, **ratios})
    return out


def throughput_markdown(rows: list[dict], rates: Sequence[str], compressors: Sequence[str]) -> str:
    """One table per (backend, model), headed by its ranks and the inner SGD's momentum: a row
    per compressor, per rate ms/step, ×dense, ×FP16."""
    index = {(r["backend"], r["model"], r["rate"], r["compressor"]): r for r in rows}
    jobs = list(dict.fromkeys((r["backend"], r["model"], r["ranks"], r["momentum"]) for r in rows))
    head = ["compressor", "bytes/step/rank"]
    head += [f"{rate} {col}" for rate in rates for col in ("ms/step", "×dense", "×FP16")]
    parts = []
    for backend, model, ranks, momentum in jobs:
        lines = [f"### {backend}, {model}, {ranks} ranks, SGD momentum {momentum:g}", ""]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name in compressors:
            found = [index.get((backend, model, rate, name)) for rate in rates]
            if not any(found):  # not run in this job (the probes under MWMS)
                continue
            sent = next((r["bytes_per_step"] for r in found if r), None)
            cells = [_label(name), _fmt(sent, ",")]
            for r in found:
                r = r or {}
                cells += [
                    _fmt(r.get("best_ms"), ".1f"),
                    _fmt(r.get("x_dense"), ".2f"),
                    _fmt(r.get("x_fp16"), ".2f"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def floor_markdown(rows: list[dict], rates: Sequence[str]) -> str:
    """Per (backend, model, rate) with the compute-only probe: its step, its lockstep floor
    (mean over steps of the slowest process's step), their ratio, and TopK 1% and compute in
    lockstep against each; "–" where a configuration did not run."""
    best = _best_ms(rows)
    floor = {
        (r["backend"], r["model"], r["rate"]): r["floor_ms"]
        for r in rows
        if r["compressor"] == "compute"
    }
    head = ["backend, model", "rate", "compute ms/step", "floor ms/step", "floor / compute"]
    head += ["TopK 1% / compute", "TopK 1% / floor", "compute + lockstep / floor"]
    lines = []
    for backend, model in dict.fromkeys((r["backend"], r["model"]) for r in rows):
        for rate in rates:
            job = (backend, model, rate)
            if job not in floor:
                continue
            compute, lowest = best[(*job, "compute")], floor[job]
            topk, sync = (best.get((*job, name)) for name in ("topk1", "compute_sync"))
            cells = [f"{backend}, {model}", rate, f"{compute:.1f}", f"{lowest:.1f}"]
            cells.append(f"{lowest / compute:.3f}")
            cells += [_fmt(None if topk is None else topk / compute, ".3f")]
            cells += [_fmt(None if ms is None else ms / lowest, ".3f") for ms in (topk, sync)]
            lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return ""
    title = "\n### Lockstep floor: mean over steps of the slowest process's compute-only step\n\n"
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *lines]
    return title + "\n".join(table) + "\n"


def exchange_probe(name: str) -> str | None:
    """The exchange-only probe that moves the payloads of benchmark name ``name`` (a late
    variant's: its compressor's), or None."""
    base = LATE.get(name, (name,))[0]
    return next((probe for probe, moved in EXCHANGE_ONLY.items() if moved == base), None)


def overlap_markdown(rows: list[dict], rates: Sequence[str]) -> str:
    """Per (backend, model, method) with an exchange-only probe for it: the method's step
    against the larger of its halves, ``max(compute, exchange only)`` (1.0 would be perfect
    overlap), with compute only and, when measured, compute in lockstep."""
    best = _best_ms(rows)
    jobs = list(dict.fromkeys((r["backend"], r["model"], r["compressor"]) for r in rows))
    lines = []
    for backend, model, name in jobs:
        exchange_name = exchange_probe(name)
        if name in PROBES or exchange_name is None:
            continue
        for probe in ("compute", "compute_sync"):
            cells = []
            for rate in rates:
                step, compute, exchange = (
                    best.get((backend, model, rate, n)) for n in (name, probe, exchange_name)
                )
                if None not in (step, compute, exchange):
                    ratio = step / max(compute, exchange)
                    cells.append(
                        f"{rate}: {step:.1f} / max({compute:.1f}, {exchange:.1f}) = {ratio:.2f}"
                    )
            if cells:
                lines.append(f"- {backend}, {model}, {name}, {probe}: " + "; ".join(cells))
    if not lines:
        return ""
    head = "\n### Overlap: step / max(compute probe, exchange only), ms\n\n"
    return head + "\n".join(lines) + "\n"


def fit_markdown(rows: list[dict], rates: Sequence[str]) -> str:
    """Per (backend, model) with the custom-loop probe: TopK 1% through ``model.fit`` against
    the same step in a custom loop, and against computing alone."""
    best = _best_ms(rows)
    lines = []
    for backend, model in dict.fromkeys((r["backend"], r["model"]) for r in rows):
        cells = []
        for rate in rates:
            fit, loop, compute = (
                best.get((backend, model, rate, name))
                for name in ("topk1", "loop_topk1", "compute")
            )
            if None not in (fit, loop, compute):
                cells.append(f"{rate}: {fit / loop:.3f} / {fit / compute:.3f}")
        if cells:
            lines.append(f"- {backend}, {model}: " + "; ".join(cells))
    if not lines:
        return ""
    head = "\n### TopK 1% with model.fit / custom loop, and / compute only\n\n"
    return head + "\n".join(lines) + "\n"


def time_to_target(points: list[dict], task: Task, target: float) -> dict | None:
    """The first epoch record whose score reaches ``target`` (as ``task`` reads scores), or
    None."""
    return next((p for p in points if task.reached(p["score"], target)), None)


def curves(records: list[dict]) -> dict[str, list[dict]]:
    """Epoch records by compressor, in epoch order."""
    out: dict[str, list[dict]] = {}
    for record in records:
        if record["event"] == "epoch":
            out.setdefault(record["compressor"], []).append(record)
    return out


def accuracy_markdown(records: list[dict], task: Task, target: float) -> str:
    """The target, then a row per compressor: bytes, seconds, steps and epochs to ``target``,
    final score, training seconds."""
    sent = {r["compressor"]: r["bytes_per_step"] for r in records if r["event"] == "result"}
    relation = ">=" if task.higher_is_better else "<="
    head = ["compressor", "bytes/step/rank", "s to target", "steps to target"]
    head += ["epochs to target", f"final {task.metric}", "train s"]
    lines = [f"Target: {task.metric} {relation} {target:g}", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, points in curves(records).items():
        hit = time_to_target(points, task, target) or {}
        cells = [_label(name), _fmt(sent.get(name), ",")]
        cells += [_fmt(hit.get("seconds"), ".1f"), _fmt(hit.get("step"), "d")]
        cells += [_fmt(hit.get("epoch"), "d")]
        cells += [f"{points[-1]['score']:.4f}", f"{points[-1]['seconds']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    autos = [auto_line(r) for r in records if r["event"] == "result" and r.get("auto_decisions")]
    return "\n".join(lines + ([""] + autos if autos else [])) + "\n"


def auto_line(result: dict) -> str:
    """What Auto chose, from its result record: its last decision's settings (units per
    setting), the step it predicted and measured, and its decisions' count and cost."""
    counts = Counter(result["auto_settings"])
    settings = ", ".join(f"{n} × {setting}" for setting, n in counts.most_common())
    predicted, measured = result["auto_predicted_ms"], result["auto_measured_ms"]
    return (
        f"- {_label(result['compressor'])}: {result['auto_decisions']} decisions; the last: "
        f"{settings} (units); step predicted {predicted:.1f} ms, measured {measured:.1f} ms; "
        f"probes and decisions {result['auto_overhead_s']:.1f} s"
    )


def _fit_title(ax: Axes, title: str) -> None:
    """Sets ``title`` on ``ax``, broken at spaces into as few lines as keep it within the
    width of the axes, once laid out (so within the figure)."""
    fig = ax.get_figure()
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    for width in range(len(title), 0, -1):
        text = ax.set_title(textwrap.fill(title, width, break_long_words=False))
        if text.get_window_extent(renderer).width <= ax.bbox.width:
            return


def accuracy_figure(records: list[dict], task: Task, target: float, title: str) -> Figure:
    """``task``'s score against training wall-clock seconds, one line per compressor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), layout="constrained")
    for name, points in curves(records).items():
        seconds = [p["seconds"] for p in points]
        ax.plot(seconds, [p["score"] for p in points], marker="o", ms=3, label=_label(name))
    ax.axhline(target, color="gray", ls="--", lw=1)
    ax.set_xlabel("wall-clock seconds of training (rank 0)")
    ax.set_ylabel(task.metric)
    ax.legend()
    ax.grid(alpha=0.3)
    _fit_title(ax, title)
    return fig


def plot_accuracy(records: list[dict], task: Task, target: float, title: str, path: str) -> None:
    """:func:`accuracy_figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = accuracy_figure(records, task, target, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(stem: str, markdown: str, data: dict) -> list[str]:
    """Write ``stem.md`` and ``stem.json``; return their paths."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    with open(stem + ".md", "w") as f:
        f.write(markdown)
    with open(stem + ".json", "w") as f:
        json.dump(data, f, indent=1)
    return [stem + ".md", stem + ".json"]
