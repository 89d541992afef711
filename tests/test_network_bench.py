"""The bandwidth benchmark (``benchmarks/network``).

``python -m benchmarks.network --quick --momentum 0.9`` runs end to end once for the module:
real ``horovodrun -np 2 --gloo`` and real MultiWorkerMirroredStrategy worker processes, every
compressor, a tiny model, an unlimited link, inside a private network namespace where root and
iproute2 allow it (outside otherwise). The tiny transformer runs too, smaller: Horovod with three
compressors, and the accuracy mode's next-token task for two epochs. The tests assert what it
wrote and printed, never timings.
The no-root fallback is checked through ``TF_SPARSIFY_BENCH_NO_ROOT=1``; the namespace itself
(rate limit set, processes killed, namespace deleted) directly, where it can be made.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from benchmarks.network import report, run
from benchmarks.network.affinity import local_rank, rank_cores
from benchmarks.network.jobs import JobFailed, run_job
from benchmarks.network.models import (
    BACKEND_PROBES,
    COMPRESSORS,
    EXCHANGE_ONLY,
    LATE,
    PROBES,
    exchange_setup,
)
from benchmarks.network.netns import PRETEND_NO_ROOT_ENV, shaped_namespace, unavailable_reason
from benchmarks.network.steps import lockstep_floor, slowest_pace
from benchmarks.network.tasks import TASKS
from tests.script_runner import ROOT

BACKENDS = ("horovod", "mwms")
#: what each backend runs: the compressors and its own probes
NAMES = {
    backend: tuple(c for c in COMPRESSORS if c not in PROBES or c in BACKEND_PROBES[backend])
    for backend in BACKENDS
}
TIMEOUT_S = 300
MOMENTUM = 0.9  # the quick run's inner SGD


def run_quick(stem: str, *argv: str) -> tuple[str, dict, str]:
    """``python -m benchmarks.network --quick ARGV``'s ``(stdout, JSON, markdown)``. Past
    ``TIMEOUT_S`` it gets SIGTERM, on which it stops its jobs and deletes its namespaces, and
    the test fails."""
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop(PRETEND_NO_ROOT_ENV, None)
    command = [sys.executable, "-m", "benchmarks.network", "--quick", "--out", stem, *argv]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=60)
        pytest.fail(
            f"quick benchmark still running after {TIMEOUT_S} s:\n{out[-4000:]}\n{err[-4000:]}"
        )
    assert proc.returncode == 0, f"quick benchmark failed:\n{out[-4000:]}\n{err[-6000:]}"
    with open(stem + ".json") as f, open(stem + ".md") as g:
        return out, json.load(f), g.read()


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> tuple[str, dict, str]:
    """The quick run: both backends, every compressor and probe, the tiny MLP, SGD momentum."""
    stem = str(tmp_path_factory.mktemp("network_bench") / "bench")
    return run_quick(stem, "--momentum", str(MOMENTUM))


def _rows(data: dict) -> dict[tuple[str, str], dict]:
    return {(r["backend"], r["compressor"]): r for r in data["rows"]}


@pytest.mark.processes
def test_a_row_per_backend_and_compressor(quick):
    _, data, _ = quick
    rows = _rows(data)
    assert len(data["rows"]) == len(rows) == sum(len(names) for names in NAMES.values())
    settings = data["settings"]
    for backend in BACKENDS:
        for name in NAMES[backend]:
            row = rows[(backend, name)]
            assert (row["model"], row["rate"], row["ranks"]) == ("tiny", "unlimited", 2)
            assert row["momentum"] == MOMENTUM
            assert row["best_ms"] > 0 and row["median_ms"] >= row["best_ms"]
            assert len(row["windows_ms"]) == len(row["floor_windows_ms"]) == settings["rounds"]
            # each window's floor is at least its ms/step, so the best ones keep that order
            assert math.isfinite(row["floor_ms"])
            assert row["floor_ms"] == min(row["floor_windows_ms"])
            assert row["floor_ms"] >= row["best_ms"] * (1 - 1e-9)
            steps = settings["warmup"] + settings["rounds"] * settings["window"]
            local = name in ("compute", "compute_sync")  # exchange nothing
            # under mwms each fit (the warm-up, then a window each round) of a late
            # configuration ends by applying what is in flight: one more step (horovod's
            # trainers step with train_on_batch)
            fits = 1 + settings["rounds"]
            flushes = fits if name in LATE and backend == "mwms" else 0
            assert row["steps"] == (0 if local else steps + flushes)
            assert row["x_dense"] > 0 and row["x_fp16"] > 0
        assert rows[(backend, "identity")]["x_dense"] == 1.0
        assert rows[(backend, "fp16")]["x_fp16"] == 1.0
        auto = rows[(backend, "auto")]  # --quick: a decision every 5 steps
        assert auto["auto_decisions"] >= 1 and auto["auto_predicted_ms"] > 0
        assert set(auto["auto_settings"]) <= {"dense", "fp16", "topk1%", "topk0.1%"}
    assert data["complete"] is True


@pytest.mark.processes
def test_compressed_payloads_are_smaller(quick):
    _, data, _ = quick
    rows = _rows(data)
    for backend in BACKENDS:
        dense = rows[(backend, "identity")]["bytes_per_step"]
        assert dense > 0
        assert rows[(backend, "topk1")]["bytes_per_step"] < dense
        assert (
            rows[(backend, "topk0.1")]["bytes_per_step"]
            < rows[(backend, "topk1")]["bytes_per_step"]
        )
        assert rows[(backend, "fp16")]["bytes_per_step"] < dense
    # the same payloads whichever front end moves them (Auto's depend on each job's timing)
    for name in set(NAMES["mwms"]) & set(NAMES["horovod"]) - {"auto"}:
        assert rows[("horovod", name)]["bytes_per_step"] == rows[("mwms", name)]["bytes_per_step"]
    # each exchange-only probe moves exactly its compressor's payloads
    for probe, moved in EXCHANGE_ONLY.items():
        assert (
            rows[("horovod", probe)]["bytes_per_step"] == rows[("horovod", moved)]["bytes_per_step"]
        )


@pytest.mark.processes
def test_progress_and_tables(quick):
    stdout, data, markdown = quick
    settings = data["settings"]
    windows = [line for line in stdout.splitlines() if "ms/step" in line and "round" in line]
    assert len(windows) == sum(len(n) for n in NAMES.values()) * settings["rounds"]
    for backend in BACKENDS:
        assert f"### {backend}, tiny, 2 ranks, SGD momentum {MOMENTUM:g}" in markdown
        assert f"| {backend}, tiny | unlimited | " in markdown  # the lockstep floor's row
    for name, label in COMPRESSORS.items():
        assert markdown.count(f"| {label} |") == sum(name in n for n in NAMES.values())
    for name in ("topk1", *LATE):  # the overlap lines: each against its exchange-only probe
        for probe in ("compute", "compute_sync"):
            assert f"- horovod, tiny, {name}, {probe}: unlimited: " in markdown
    assert "- mwms, tiny: unlimited: " in markdown  # model.fit against the custom loop
    assert "unlimited ×dense" in markdown and "best of" in markdown
    assert "### Lockstep floor" in markdown and "lockstep floor: each process" in data["timing"]


def test_lockstep_floor_of_a_window():
    """Two ranks, three steps: each rank's window is 6 s and 5 s (slowest pace 2 s/step), but
    in lockstep every step waits for the slower rank: (2 + 3 + 2) / 3."""
    step_times = np.array([[1.0, 3.0, 2.0], [2.0, 1.0, 2.0]])
    assert slowest_pace(step_times) == 2.0
    assert lockstep_floor(step_times) == pytest.approx(7 / 3)
    assert lockstep_floor(step_times[:1]) == slowest_pace(step_times[:1]) == 2.0  # one rank
    for bad in (np.ones(3), np.ones((2, 0)), np.array([[1.0, np.nan]]), -np.ones((2, 2))):
        with pytest.raises(ValueError, match="step_times must be"):
            lockstep_floor(bad)


def test_floor_table_reads_its_ratios_from_one_job():
    job = {"backend": "horovod", "model": "m", "rate": "unlimited", "ranks": 2, "momentum": 0}
    ms = {"compute": (100.0, 110.0), "compute_sync": (112.2, 112.2), "topk1": (121.0, 121.0)}
    rows = [job | {"compressor": c, "best_ms": b, "floor_ms": f} for c, (b, f) in ms.items()]
    table = report.floor_markdown(rows, ["1gbit", "unlimited"])
    assert "| horovod, m | unlimited | 100.0 | 110.0 | 1.100 | 1.210 | 1.100 | 1.020 |" in table
    assert "1gbit" not in table  # no job at that rate
    no_probes = [r for r in rows if r["compressor"] == "topk1"]
    assert report.floor_markdown(no_probes, ["unlimited"]) == ""


@pytest.mark.processes
def test_the_report_says_how_processes_share_the_cores(quick):
    _, data, _ = quick
    cores = len(os.sched_getaffinity(0))
    if cores >= 2:
        assert f"pinned to its own {cores // 2} of the {cores} cores" in data["timing"]
    else:
        assert f"not pinned: {cores} cores for 2 processes" in data["timing"]


def test_each_rank_gets_its_own_share_of_the_cores():
    assert rank_cores(0, 2, [3, 0, 2, 1]) == [0, 1]
    assert rank_cores(1, 2, [0, 1, 2, 3, 4]) == [2, 3]
    assert rank_cores(2, 3, [0, 1, 2]) == [2]
    assert rank_cores(1, 3, [0, 1]) is None  # fewer cores than ranks: not pinned
    with pytest.raises(ValueError, match="rank must be in \\[0, 2\\), got 2"):
        rank_cores(2, 2, [0, 1])


def test_local_rank_from_either_launcher(monkeypatch):
    for name in ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert local_rank() is None
    cluster = {"worker": ["localhost:1", "localhost:2", "localhost:3"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": cluster, "task": {"index": 2}}))
    assert local_rank() == (2, 3)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "2")
    assert local_rank() == (1, 2)


@pytest.mark.processes
@pytest.mark.parametrize("pin", [True, False])
def test_a_job_process_pins_itself_when_asked(tmp_path, monkeypatch, pin):
    """Through run_job's environment, as the workers do: rank 1 of 2 takes the upper half of
    the cores with pin=True and keeps them all with pin=False."""
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "1")
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "2")
    results, log = str(tmp_path / "r.jsonl"), str(tmp_path / "job.log")
    script = (
        "import json, os\n"
        "from benchmarks.network.affinity import pin_to_rank_cores\n"
        "pinned = pin_to_rank_cores()\n"
        f"open({results!r}, 'a').write(json.dumps({{'pinned': pinned, "
        "'cores': sorted(os.sched_getaffinity(0))}) + '\\n')\n"
    )
    (record,) = run_job([sys.executable, "-c", script], results, log, 60, print, pin=pin)
    cores = sorted(os.sched_getaffinity(0))
    share = rank_cores(1, 2, cores)
    if pin and share is not None:
        assert record == {"pinned": share, "cores": share}
    else:
        assert record == {"pinned": None, "cores": cores}


@pytest.mark.processes
def test_runs_in_a_namespace_when_it_can(quick):
    _, data, _ = quick
    reason = unavailable_reason()
    if reason is None:
        assert "network namespace" in data["network"]
    else:
        assert data["network"] == f"unlimited only, no namespace: {reason}"


def test_without_root_it_says_so_and_runs_unlimited_only(monkeypatch, capsys):
    monkeypatch.setenv(PRETEND_NO_ROOT_ENV, "1")
    args = run.parse_args(["--rates", "1gbit,10gbit,unlimited", "--backend", "mwms"])
    shaped, note = run.plan_network(args)
    assert not shaped and args.rates == ["unlimited"]
    assert PRETEND_NO_ROOT_ENV in note
    assert "running unlimited only" in capsys.readouterr().out
    with run.link("unlimited", shaped) as prefix:
        assert prefix == []


def test_bad_arguments_are_rejected(capsys):
    bad = (["--rates", "fast"], ["--compressors", "topk7"], ["--backend", "mpi"], ["--np", "0"])
    for argv in bad:
        with pytest.raises(SystemExit):
            run.parse_args(argv)
    for argv, message in (
        (["--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
        (["--momentum", "-0.5"], "--momentum must be in [0, 1), got -0.5"),
        (["--mode", "accuracy", "--momentum", "0.9"], "--momentum is for --mode throughput"),
        (["--bucket-bytes", "0"], "--bucket-bytes is a positive size for --mode throughput"),
        (["--mode", "accuracy", "--bucket-bytes", "4096"], "--bucket-bytes is a positive size"),
        (["--auto-interval", "1"], "--auto-interval must be >= 2, got 1"),
    ):
        with pytest.raises(SystemExit):
            run.parse_args(argv)
        assert message in capsys.readouterr().err
    assert run.parse_args(["--momentum", "0.9"]).momentum == 0.9
    with pytest.raises(SystemExit):
        run.parse_args(["--mode", "accuracy", "--rates", "1gbit,10gbit"])


def test_exchange_setup_gives_the_late_mode_and_the_bucket_size():
    assert exchange_setup("topk1_late", 2 << 20)[1] == {
        "bucket_bytes": 2 << 20,
        "late_buckets": "last",
    }
    assert exchange_setup("identity_late")[1] == {"late_buckets": "all"}
    compressor, options = exchange_setup("exchange_fp16", 4096)
    assert type(compressor).__name__ == "FP16" and options == {"bucket_bytes": 4096}


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.processes
def test_namespace_is_limited_and_always_cleaned_up():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"no rate-limited namespace here: {reason}")
    with pytest.raises(KeyboardInterrupt):
        with shaped_namespace("100mbit") as prefix:
            name = prefix[-1]
            qdisc = subprocess.run(
                [*prefix, "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True
            )
            assert "tbf" in qdisc.stdout and "100Mbit" in qdisc.stdout
            links = subprocess.run([*prefix, "ip", "-o", "link"], capture_output=True, text=True)
            assert [line.split(":")[1].strip() for line in links.stdout.splitlines()] == ["lo"]
            sleeper = subprocess.Popen([*prefix, "sleep", "60"])
            time.sleep(0.2)
            raise KeyboardInterrupt  # as Ctrl-C would
    assert sleeper.wait(timeout=10) != 0  # killed, not finished
    assert name not in _namespaces()


@pytest.mark.processes
def test_run_job_streams_records_and_reports_failures(tmp_path):
    results, log = str(tmp_path / "r.jsonl"), str(tmp_path / "job.log")
    write = f"import json; open({results!r}, 'a').write(json.dumps({{'event': 'x'}}) + '\\n')"
    seen: list[dict] = []
    assert run_job([sys.executable, "-c", write], results, log, 30, seen.append) == seen
    assert seen == [{"event": "x"}]
    with pytest.raises(JobFailed, match="(?s)exited 3.*boom"):
        run_job([sys.executable, "-c", "print('boom'); exit(3)"], results, log, 30, print)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.processes
def test_run_job_kills_a_stuck_job_with_what_it_started(tmp_path):
    pid_file = tmp_path / "pid"
    stuck = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; sleep 60"]
    results, log = str(tmp_path / "r.jsonl"), str(tmp_path / "job.log")
    start = time.monotonic()
    with pytest.raises(JobFailed, match="did not finish within 1 s"):
        run_job(stuck, results, log, 1, print)
    assert time.monotonic() - start < 20
    assert _gone(int(pid_file.read_text()))


@pytest.mark.processes
def test_quick_transformer_throughput(tmp_path):
    """--quick --models transformer trains the tiny transformer (8 sequences per rank) under
    Horovod; TopK sends less than dense."""
    names = ("identity", "topk1")
    argv = ["--backend", "horovod", "--models", "transformer", "--compressors", ",".join(names)]
    stdout, data, markdown = run_quick(str(tmp_path / "bench"), *argv)
    rows = {r["compressor"]: r for r in data["rows"]}
    assert set(rows) == set(names)
    for row in rows.values():
        assert (row["model"], row["batch"], row["ranks"]) == ("transformer_tiny", 8, 2)
        assert row["momentum"] == 0.0  # the default: plain SGD
        assert row["best_ms"] > 0
    assert 0 < rows["topk1"]["bytes_per_step"] < rows["identity"]["bytes_per_step"]
    assert "### horovod, transformer_tiny, 2 ranks, SGD momentum 0" in markdown
    assert stdout.count("transformer_tiny") >= len(names) * data["settings"]["rounds"]


@pytest.mark.processes
def test_quick_transformer_time_to_target_loss(tmp_path):
    """--mode accuracy --quick --models transformer: the tiny transformer's next-token task for
    two epochs with dense and Auto (a decision every 5 steps); the held-out loss of each falls,
    and the report says what Auto chose."""
    argv = ["--mode", "accuracy", "--models", "transformer", "--compressors", "identity,auto"]
    _, data, markdown = run_quick(str(tmp_path / "accuracy"), *argv)
    task = TASKS["transformer_tiny"]
    assert data["settings"]["models"] == ["transformer_tiny"]
    assert data["settings"]["target"] == task.target and data["complete"] is True
    curves = report.curves(data["records"])
    assert set(curves) == {"identity", "auto"}
    results = {r["compressor"]: r for r in data["records"] if r["event"] == "result"}
    assert results["auto"]["auto_decisions"] == 2 * task.steps // 5
    assert set(results["auto"]["auto_settings"]) <= {"dense", "fp16", "topk1%", "topk0.1%"}
    assert "auto_decisions" not in results["identity"]
    assert "- Auto (AutoCompression): 4 decisions; the last: " in markdown
    for points in curves.values():
        assert [p["epoch"] for p in points] == [0, 1, 2]
        assert [p["step"] for p in points] == [0, task.steps, 2 * task.steps]
        assert points[-1]["score"] < points[0]["score"] - 0.5
        assert points[0]["seconds"] == 0 < points[1]["seconds"] < points[2]["seconds"]
    assert f"Target: {task.metric} <= {task.target:g}" in markdown
    assert (tmp_path / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_quick_and_the_accuracy_mode_choose_their_models():
    args = run.parse_args(["--quick", "--models", "mlp10m,mobilenetv2,transformer"])
    assert args.models == ["tiny", "transformer_tiny"]
    assert run.parse_args([]).models == ["mlp10m", "mobilenetv2"]
    args = run.parse_args(["--mode", "accuracy"])
    digits = TASKS["digits"]
    assert args.models == ["digits"]
    assert (args.epochs, args.batch, args.target) == (digits.epochs, digits.batch, digits.target)
    args = run.parse_args(["--mode", "accuracy", "--models", "transformer", "--target", "3.5"])
    assert (args.batch, args.target) == (TASKS["transformer"].batch, 3.5)
    for argv in (["--models", "digits"], ["--mode", "accuracy", "--models", "mlp10m"]):
        with pytest.raises(SystemExit):
            run.parse_args(argv)
    with pytest.raises(SystemExit):
        run.parse_args(["--mode", "accuracy", "--models", "digits,transformer"])


def _epochs(curves: dict[str, list[float]], seconds_per_epoch: dict[str, float]) -> list[dict]:
    records = []
    for name, curve in curves.items():
        for number, score in enumerate(curve):
            records.append(
                {"event": "epoch", "compressor": name, "epoch": number, "step": 10 * number}
                | {"seconds": seconds_per_epoch[name] * number, "score": score}
            )
        records.append({"event": "result", "compressor": name, "bytes_per_step": 100})
    return records


def test_accuracy_report_table_and_plot(tmp_path):
    curves = {"identity": [0.1, 0.85, 0.93], "topk1": [0.1, 0.8, 0.88]}
    records = _epochs(curves, {"identity": 2.0, "topk1": 0.5})
    digits = TASKS["digits"]
    table = report.accuracy_markdown(records, digits, 0.9)
    assert "Target: test accuracy >= 0.9" in table
    assert "| Identity (dense) | 100 | 4.0 | 20 | 2 | 0.9300 | 4.0 |" in table
    assert "| TopK 1% + EF | 100 | – | – | – | 0.8800 | 1.0 |" in table
    report.plot_accuracy(records, digits, 0.9, "test", str(tmp_path / "a.png"))
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    assert "Auto" not in table


def test_the_accuracy_report_says_what_auto_chose():
    records = _epochs({"identity": [0.1, 0.93], "auto": [0.1, 0.91]}, {"identity": 2, "auto": 1})
    records[-1] |= {
        "auto_decisions": 3,
        "auto_settings": ["topk0.1%", "dense", "topk0.1%"],
        "auto_predicted_ms": 12.34,
        "auto_measured_ms": 13.0,
        "auto_overhead_s": 0.31,
    }
    table = report.accuracy_markdown(records, TASKS["digits"], 0.9)
    assert table.endswith(
        "\n\n- Auto (AutoCompression): 3 decisions; the last: 2 × topk0.1%, 1 × dense (units); "
        "step predicted 12.3 ms, measured 13.0 ms; probes and decisions 0.3 s\n"
    )


@pytest.mark.parametrize("model", ["digits", "transformer"])
def test_the_accuracy_plot_title_fits_in_the_figure(model):
    """The title as the accuracy mode writes it (the transformer's is 96 characters) lies
    inside the figure, every word kept; a short one stays on one line."""
    import matplotlib.pyplot as plt

    task = TASKS[model]
    title = f"{task.title}, 2 Horovod ranks, 1gbit"
    records = _epochs({"identity": [10.4, 6.0, 4.2]}, {"identity": 3.0})
    fig = report.accuracy_figure(records, task, task.target, title)
    fig.canvas.draw()
    shown = fig.axes[0].title
    extent, frame = shown.get_window_extent(), fig.bbox
    assert frame.x0 <= extent.x0 and extent.x1 <= frame.x1 and extent.y1 <= frame.y1, extent
    assert " ".join(shown.get_text().split()) == title
    assert ("\n" in shown.get_text()) == (model == "transformer")
    plt.close(fig)


def test_a_loss_target_is_reached_from_above():
    records = _epochs(
        {"identity": [10.4, 6.0, 4.2], "fp16": [10.4, 7.0, 5.5]}, {"identity": 3.0, "fp16": 2.0}
    )
    table = report.accuracy_markdown(records, TASKS["transformer"], 5.0)
    assert "Target: eval loss (nats/token) <= 5" in table
    assert "| Identity (dense) | 100 | 6.0 | 20 | 2 | 4.2000 | 6.0 |" in table
    assert "| FP16 | 100 | – | – | – | 5.5000 | 4.0 |" in table
