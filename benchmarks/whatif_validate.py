"""The network what-if against the bandwidth benchmark: predicted vs measured ms/step.

    python -m benchmarks.whatif_validate outputs/network_bench.json [MORE.json ...] [--markdown]

Reads the Horovod rows of ``python -m benchmarks.network`` (per job: backend, model, rate,
ranks P; per compressor: ``best_ms`` and ``bytes_per_step``, the payload one rank hands Horovod;
the ``compute`` and ``exchange_topk1`` probes). For each (model, P) the **unlimited** job
calibrates the host, and each rated job (1gbit, 10gbit, ...) is predicted from it:

- payloads: Identity and FP16 by ring all-reduce (one rank sends ``s = 2 (P - 1) / P * m``),
  TopK, QSGD and the exchange probe by all-gather (``s = (P - 1) m``).
- link: the job's tc rate, one limit for all ranks (shared medium: ``P s`` bytes queue behind
  it) less the token bucket's burst (512 KiB, refilled while the step computes); alpha per
  round 0 (loopback round trips are microseconds).
- fitted at unlimited: ``call_overhead`` ``t0`` (per collective call: Horovod's negotiation and
  fusion, the step's dispatch) and ``host_bandwidth`` ``B`` (copies and kernel TCP on the
  shared cores) from ``T_identity - T_compute = t0 + s_dense / B`` and
  ``T_exchange_topk1 = t0 + s_probe / B``; each compressor's ``overhead`` (select, encode,
  decode) as ``T_c - T_compute - comm_c`` (Identity's is 0 by construction).
- predicted: ``T_c(R) = compute(R) + overhead_c + t0 + max(wire(R), s / B)``, with
  ``compute(R)`` the same job's compute probe, ``wire(R) = max(0, P s - burst) / R``.
- every bucket late (``identity_late``, ``fp16_late``): the exchange runs while the next step
  computes, but its host work (``t0 + s / B``: copies, kernel TCP) runs on the rank's own
  core, so only the wire hides: ``T = overhead_c + max(compute(R) + t0 + s / B, t0 + wire(R))``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.network.netns import BURST, UNLIMITED
from tf_sparsify.analysis import whatif as w
from tf_sparsify.analysis.whatif_cli_values import parse_bandwidth, parse_size

GATHERED = ("topk1", "topk0.1", "qsgd4", "exchange_topk1")
SUMMED = ("identity", "fp16")
#: rows with every bucket one step late, and the compressor each runs
ALL_LATE = {"identity_late": "identity", "fp16_late": "fp16"}
TARGET = 0.25


@dataclass(frozen=True)
class Calibration:
    """What the unlimited job gives: seconds per call, host bytes/s, overhead s per compressor."""

    call_overhead: float
    host_bandwidth: float
    overheads: dict[str, float]


def transfer(compressor: str, payload: float, ranks: int) -> w.Transfer:
    """The collective that carries ``compressor``'s payload of ``payload`` bytes."""
    move = w.all_gather if compressor in GATHERED else w.all_reduce
    return move(payload, ranks, "ring")


def comm(compressor: str, row: dict, link: w.Link) -> float:
    return w.link_time([transfer(compressor, row["bytes_per_step"], row["ranks"])], link)


def late_step(base: str, row: dict, link: w.Link, compute: float, overhead: float) -> float:
    """Every bucket late: the wire hides under the next step, the host work does not."""
    sent = transfer(base, row["bytes_per_step"], row["ranks"])
    host = w.link_time([sent], dataclasses.replace(link, bandwidth=math.inf))
    wire = w.link_time([sent], dataclasses.replace(link, host_bandwidth=math.inf))
    return overhead + max(compute + host, wire)


def fit_host(dense: dict, probe: dict | None, compute: float) -> tuple[float, float]:
    """``(t0, B)`` from the dense step and the exchange probe (seconds); clamped to ``t0 >= 0``
    and ``B > 0`` (without the probe: ``t0 = 0``)."""
    ranks = dense["ranks"]
    c_dense = max(dense["best_ms"] / 1e3 - compute, 0.0)
    s_dense = transfer("identity", dense["bytes_per_step"], ranks).bytes_sent
    if probe is None:
        return 0.0, s_dense / c_dense if c_dense else math.inf
    c_probe = probe["best_ms"] / 1e3
    s_probe = transfer("exchange_topk1", probe["bytes_per_step"], ranks).bytes_sent
    per_byte = max((c_dense - c_probe) / (s_dense - s_probe), 0.0)
    t0 = c_probe - s_probe * per_byte
    if t0 < 0:
        t0, per_byte = 0.0, c_dense / s_dense
    return t0, (1 / per_byte if per_byte else math.inf)


def host_link(rate: str, calibration: Calibration) -> w.Link:
    """The job's link: the tc rate shared by all ranks, or unlimited (host bound only)."""
    return w.Link(
        math.inf if rate == UNLIMITED else parse_bandwidth(rate),
        shared=True,
        burst_bytes=parse_size(BURST),
        host_bandwidth=calibration.host_bandwidth,
        call_overhead=calibration.call_overhead,
    )


def calibrate(unlimited: dict[str, dict]) -> Calibration:
    """The host's terms from the unlimited job's rows (by compressor)."""
    compute = unlimited["compute"]["best_ms"] / 1e3
    t0, host = fit_host(unlimited["identity"], unlimited.get("exchange_topk1"), compute)
    calibration = Calibration(t0, host, {})
    link = host_link(UNLIMITED, calibration)
    for name, row in unlimited.items():
        if name in SUMMED + GATHERED and name != "exchange_topk1":
            spent = row["best_ms"] / 1e3 - compute - comm(name, row, link)
            calibration.overheads[name] = 0.0 if name == "identity" else spent
    return calibration


def predict_job(rows: dict[str, dict], rate: str, calibration: Calibration) -> list[dict]:
    """Predicted vs measured ms/step of each compressor (and the probe) of one rated job."""
    link = host_link(rate, calibration)
    compute = rows["compute"]["best_ms"] / 1e3
    out = []
    for name, row in rows.items():
        if name == "exchange_topk1":
            predicted = comm(name, row, link)
        elif name in calibration.overheads:
            predicted = compute + calibration.overheads[name] + comm(name, row, link)
        elif ALL_LATE.get(name) in calibration.overheads:
            base = ALL_LATE[name]
            predicted = late_step(base, row, link, compute, calibration.overheads[base])
        else:
            continue
        measured = row["best_ms"] / 1e3
        out.append(
            {
                "compressor": name,
                "measured_ms": 1e3 * measured,
                "predicted_ms": 1e3 * predicted,
                "error": predicted / measured - 1,
            }
        )
    return out


def by_job(rows: Sequence[dict]) -> dict[tuple[str, int], dict[str, dict[str, dict]]]:
    """Horovod rows as ``{(model, ranks): {rate: {compressor: row}}}``."""
    jobs: dict[tuple[str, int], dict[str, dict[str, dict]]] = {}
    for row in rows:
        if row.get("backend") == "horovod":
            rates = jobs.setdefault((row["model"], row["ranks"]), {})
            rates.setdefault(row["rate"], {})[row["compressor"]] = row
    return jobs


def validate(rows: Sequence[dict]) -> tuple[list[dict], list[str]]:
    """Comparison rows for every rated Horovod job, and notes (calibrations, skipped jobs)."""
    results, notes = [], []
    for (model, ranks), rates in by_job(rows).items():
        unlimited = rates.get(UNLIMITED)
        if not unlimited or not {"identity", "compute"} <= set(unlimited):
            notes.append(
                f"{model}, P={ranks}: skipped (needs the unlimited job's identity and "
                "compute rows to calibrate the host)"
            )
            continue
        calibration = calibrate(unlimited)
        overheads = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in calibration.overheads.items())
        notes.append(
            f"{model}, P={ranks}: call overhead {1e3 * calibration.call_overhead:.1f} ms, host "
            f"{calibration.host_bandwidth / 1e6:.0f} MB/s per rank, overheads ms: {overheads}"
        )
        for rate, job in rates.items():
            if rate == UNLIMITED or "compute" not in job:
                continue
            for result in predict_job(job, rate, calibration):
                results.append({"model": model, "ranks": ranks, "rate": rate, **result})
    return results, notes


def text_table(results: Sequence[dict]) -> str:
    head = f"{'model':<12}{'P':>3} {'rate':<8}{'compressor':<16}{'measured':>10}{'predicted':>11}"
    lines = [head + f"{'error':>9}", "-" * (len(head) + 9)]
    for r in results:
        lines.append(
            f"{r['model']:<12}{r['ranks']:>3} {r['rate']:<8}{r['compressor']:<16}"
            f"{r['measured_ms']:>10.1f}{r['predicted_ms']:>11.1f}{r['error']:>+9.0%}"
        )
    return "\n".join(lines)


def markdown_table(results: Sequence[dict]) -> str:
    lines = ["| model | P | rate | compressor | measured ms/step | predicted | error |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in results:
        lines.append(
            f"| {r['model']} | {r['ranks']} | {r['rate']} | {r['compressor']} | "
            f"{r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['error']:+.0%} |"
        )
    return "\n".join(lines)


def summary(results: Sequence[dict]) -> str:
    inside = sum(abs(r["error"]) <= TARGET for r in results)
    worst = max((abs(r["error"]) for r in results), default=0.0)
    return f"{inside}/{len(results)} within {TARGET:.0%}; largest error {worst:.0%}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "json", nargs="+", help="outputs/network_bench.json of python -m benchmarks.network"
    )
    p.add_argument("--markdown", action="store_true", help="a markdown table (for the README)")
    args = p.parse_args(argv)
    rows = []
    for path in args.json:
        with open(path) as f:
            rows += json.load(f).get("rows", [])
    results, notes = validate(rows)
    print("\n".join(notes))
    if not results:
        print("no rated Horovod job with a calibration to compare", file=sys.stderr)
        return 1
    print(markdown_table(results) if args.markdown else text_table(results))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
