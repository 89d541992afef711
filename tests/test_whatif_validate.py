"""The what-if's validation script (``benchmarks/whatif_validate.py``): its calibration
recovers known host terms from synthetic benchmark rows, and its command line."""

from __future__ import annotations

import json

import pytest

from benchmarks import whatif_validate as wv

GBIT = 1e9 / 8


def synthetic_rows(ranks: int, truth: dict) -> list[dict]:
    """Benchmark rows made by the validation's own model from known host terms: the script
    must recover them and predict every rated row exactly."""
    payloads = {"identity": 40_083_496, "fp16": 20_041_748, "topk1": 508_118}
    payloads["exchange_topk1"] = payloads["topk1"]
    calibration = wv.Calibration(truth["t0"], truth["host"], {})
    rows = []
    for rate in ("unlimited", "1gbit", "10gbit"):
        link = wv.host_link(rate, calibration)
        compute = truth["compute"][rate]
        row = {"backend": "horovod", "model": "mlp10m", "rate": rate, "ranks": ranks}
        rows.append({**row, "compressor": "compute", "best_ms": 1e3 * compute, "bytes_per_step": 0})
        for name, payload in payloads.items():
            entry = {**row, "compressor": name, "bytes_per_step": payload}
            spent = wv.comm(name, entry, link)
            if name != "exchange_topk1":
                spent += compute + truth["overheads"][name]
            rows.append({**entry, "best_ms": 1e3 * spent})
    return rows


@pytest.mark.parametrize("ranks", [2, 4])
def test_validation_recovers_a_synthetic_calibration(ranks):
    truth = {
        "t0": 0.01,
        "host": 5e8,
        "compute": {"unlimited": 0.2, "1gbit": 0.25, "10gbit": 0.22},
        "overheads": {"identity": 0.0, "fp16": 0.05, "topk1": 0.04},
    }
    rows = synthetic_rows(ranks, truth)
    rows.append({**rows[0], "backend": "mwms"})  # ignored
    results, notes = wv.validate(rows)
    assert len(results) == 2 * 4 and all(abs(r["error"]) < 1e-9 for r in results)
    calibration = wv.calibrate(wv.by_job(rows)[("mlp10m", ranks)]["unlimited"])
    assert calibration.call_overhead == pytest.approx(0.01)
    assert calibration.host_bandwidth == pytest.approx(5e8)
    assert calibration.overheads == pytest.approx(truth["overheads"])
    assert "call overhead 10.0 ms" in notes[0]
    # 1gbit dense at P = 2 by hand: both ranks' 40 MB through one limit, less the burst
    if ranks == 2:
        (dense,) = [r for r in results if r["rate"] == "1gbit" and r["compressor"] == "identity"]
        wire = (2 * 40_083_496 - 512 * 1024) / GBIT
        assert dense["predicted_ms"] == pytest.approx(1e3 * (0.25 + 0.01 + wire))


def test_validation_script_main(tmp_path, capsys):
    truth = {
        "t0": 0.005,
        "host": 3e8,
        "compute": {"unlimited": 0.1, "1gbit": 0.1, "10gbit": 0.1},
        "overheads": {"identity": 0.0, "fp16": 0.02, "topk1": 0.03},
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": synthetic_rows(2, truth)}))
    assert wv.main([str(path), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| mlp10m | 2 | 1gbit | identity |" in out and "8/8 within 25%" in out
    no_unlimited = [r for r in synthetic_rows(2, truth) if r["rate"] != "unlimited"]
    path.write_text(json.dumps({"rows": no_unlimited}))
    assert wv.main([str(path)]) == 1
    assert "skipped" in capsys.readouterr().out


def test_every_bucket_late_hides_the_wire_but_not_the_host_work():
    """``identity_late`` at P = 2: at 1 Gbit/s the wire (both ranks' 40 MB through one limit)
    outlasts compute plus host work; at 10 Gbit/s the host work (t0 + 40 MB at 500 MB/s) on
    the rank's own core adds to the compute and sets the step."""
    truth = {
        "t0": 0.01,
        "host": 5e8,
        "compute": {"unlimited": 0.2, "1gbit": 0.25, "10gbit": 0.22},
        "overheads": {"identity": 0.0, "fp16": 0.05, "topk1": 0.04},
    }
    rows = synthetic_rows(2, truth)
    dense = 40_083_496
    for row in [r for r in rows if r["compressor"] == "identity" and r["rate"] != "unlimited"]:
        rows.append({**row, "compressor": "identity_late", "best_ms": 100.0})
    results, _ = wv.validate(rows)
    late = {r["rate"]: r["predicted_ms"] for r in results if r["compressor"] == "identity_late"}
    host = 0.01 + dense / 5e8
    assert late["1gbit"] == pytest.approx(1e3 * (0.01 + (2 * dense - 512 * 1024) / GBIT))
    assert late["10gbit"] == pytest.approx(1e3 * (0.22 + host))
