"""Bandwidth benchmark: real multi-process training over a rate-limited loopback.

    python -m benchmarks.network                    # throughput table (many minutes)
    python -m benchmarks.network --quick            # tiny model, a few steps, unlimited link
    python -m benchmarks.network --mode accuracy    # time to accuracy at 1gbit, with a PNG
    python -m benchmarks.network --mode accuracy --models transformer  # time to a target loss

Throughput: for each backend (``horovodrun -np P --gloo`` with ``DistributedOptimizer``;
``MultiWorkerMirroredStrategy`` custom loop with ``SparsifiedOptimizer``), model and rate, one
job whose processes all run inside a private network namespace with ``tc tbf`` on its loopback;
inside the job the compressors take turns in timed windows (see ``worker.py``). Each job's
ratios (×dense, ×FP16) come from its own interleaved windows. Accuracy: one task of
``tasks.TASKS`` (``--models``: digits, transformer), its score after each epoch against each
compressor's training seconds (see ``accuracy_worker.py``). Needs root and iproute2; without
them it says why and runs unlimited only, outside any namespace.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.util import find_spec

from benchmarks.network import report
from benchmarks.network.jobs import JobFailed, horovod_command, mwms_command, run_job
from benchmarks.network.models import (
    BACKEND_PROBES,
    BATCH,
    COMPRESSORS,
    MODELS,
    PROBES,
    QUICK_MODELS,
)
from benchmarks.network.netns import (
    BURST,
    LATENCY,
    UNLIMITED,
    check_rate,
    shaped_namespace,
    unavailable_reason,
)
from benchmarks.network.tasks import TASKS

BACKENDS = ("horovod", "mwms")
DEFAULTS = {
    "throughput": {
        "models": "mlp10m,mobilenetv2",
        "rates": "1gbit,10gbit,unlimited",
        "compressors": (
            "identity,fp16,bf16,topk1,topk0.1,qsgd4,topk1_late,identity_late,fp16_late,auto,"
            "compute,compute_sync,exchange_topk1,exchange_identity,exchange_fp16,loop_topk1"
        ),
        "out": "outputs/network_bench",
    },
    "accuracy": {
        "models": "digits",
        "rates": "1gbit",
        "compressors": "identity,fp16,topk1,topk0.1,auto",
        "out": "outputs/network_accuracy",
    },
}
#: --quick: these settings, and each model replaced by its QUICK_MODELS entry
QUICK = {
    "rates": UNLIMITED,
    "rounds": 2,
    "window": 3,
    "warmup": 2,
    "epochs": 2,
    "auto_interval": 5,
}
#: the names --models takes, by mode
MODEL_NAMES = {"throughput": MODELS, "accuracy": tuple(TASKS)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--mode", choices=tuple(DEFAULTS), default="throughput")
    p.add_argument(
        "--backend", default="horovod,mwms", help=f"throughput: comma list of {BACKENDS}"
    )
    p.add_argument(
        "--models",
        help=f"throughput: comma list of {MODELS} (default mlp10m,mobilenetv2); "
        f"accuracy: one task of {tuple(TASKS)} (default digits)",
    )
    p.add_argument("--compressors", help=f"comma list of {tuple(COMPRESSORS)}")
    p.add_argument("--rates", help="comma list: tc rates (1gbit, 100mbit, ...) or unlimited")
    p.add_argument("--np", type=int, default=2, help="processes per job")
    p.add_argument("--rounds", type=int, default=5, help="timed windows per configuration")
    p.add_argument("--window", type=int, default=10, help="steps per timed window")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    p.add_argument(
        "--auto-interval",
        type=int,
        default=20,
        help="steps between Auto's decisions (let --warmup span three: e.g. --warmup 60)",
    )
    p.add_argument(
        "--batch",
        type=int,
        help=f"per process; default: throughput {BATCH}, accuracy the task's",
    )
    p.add_argument("--image-size", type=int, default=32, help="MobileNetV2 input side")
    p.add_argument(
        "--momentum",
        type=float,
        default=0.0,
        help="throughput: the inner SGD's momentum, in [0, 1) (default 0: plain SGD)",
    )
    p.add_argument(
        "--bucket-bytes",
        type=int,
        default=None,
        help="throughput: every compressor's bucket_bytes (default: the library's)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="throughput: intra-op threads per process (0: TF's default)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give each process its own share of the cores, as separate machines would have "
        "(default; needs at least --np cores)",
    )
    p.add_argument("--epochs", type=int, help="accuracy: epochs per compressor (task's default)")
    p.add_argument("--target", type=float, help="accuracy: the score to reach (the task's default)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per job")
    p.add_argument("--out", help="path stem for .md/.json (.png in accuracy mode)")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, unlimited")
    args = p.parse_args(argv)
    for key, value in DEFAULTS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.quick:
        vars(args).update(QUICK, timeout=min(args.timeout, 150))
        quick = (QUICK_MODELS.get(m, m) for m in args.models.split(","))
        args.models = ",".join(dict.fromkeys(quick))
    args.out = os.path.splitext(args.out)[0] if args.out.endswith((".md", ".json")) else args.out
    return check_args(p, args)


def _names(value: str, allowed: tuple[str, ...], what: str, p: argparse.ArgumentParser) -> list:
    names = [n for n in value.split(",") if n]
    unknown = [n for n in names if n not in allowed]
    if unknown or not names:
        p.error(f"{what}: unknown {unknown}; choose from {allowed}")
    return names


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Lists split and validated; argparse errors for unknown names or bad rates."""
    args.backend = _names(args.backend, BACKENDS, "--backend", p)
    args.models = _names(args.models, MODEL_NAMES[args.mode], "--models", p)
    args.compressors = _names(args.compressors, tuple(COMPRESSORS), "--compressors", p)
    try:
        args.rates = [check_rate(r) for r in args.rates.split(",") if r]
    except ValueError as error:
        p.error(str(error))
    if args.mode == "accuracy":
        if len(args.rates) != 1 or len(args.models) != 1:
            p.error("--mode accuracy takes one rate and one model")
        task = TASKS[args.models[0]]
        for key in ("epochs", "batch", "target"):
            if getattr(args, key) is None:
                setattr(args, key, getattr(task, key))
    if not 0 <= args.momentum < 1:
        p.error(f"--momentum must be in [0, 1), got {args.momentum}")
    if args.mode == "accuracy" and args.momentum:
        p.error(
            f"--momentum is for --mode throughput (a task picks its optimizer), got {args.momentum}"
        )
    if args.bucket_bytes is not None and (args.mode == "accuracy" or args.bucket_bytes < 1):
        p.error(f"--bucket-bytes is a positive size for --mode throughput, got {args.bucket_bytes}")
    counts = (args.np, args.rounds, args.window, args.warmup, args.epochs, args.batch)
    if min(c for c in counts if c is not None) < 1:
        p.error("--np, --rounds, --window, --warmup, --epochs and --batch must be >= 1")
    if args.auto_interval < 2:
        p.error(f"--auto-interval must be >= 2, got {args.auto_interval}")
    return args


@contextmanager
def link(rate: str, shaped: bool) -> Iterator[list[str]]:
    """The command prefix for a job at ``rate``: a fresh shaped namespace, or nothing."""
    if not shaped:
        yield []
        return
    with shaped_namespace(rate) as prefix:
        yield prefix


def plan_network(args: argparse.Namespace) -> tuple[bool, str]:
    """``(shaped, note)``: whether jobs run in rate-limited namespaces, and how, for the report.
    Without root or iproute2 it says why and leaves ``args.rates`` as ``[unlimited]``."""
    reason = unavailable_reason()
    if reason is not None:
        print(f"NOTE: no rate limiting ({reason}); running unlimited only, outside any namespace.")
        args.rates = [UNLIMITED]
        return False, f"unlimited only, no namespace: {reason}"
    return True, (
        "every process of a job inside a private network namespace; its loopback limited "
        f"with tc qdisc tbf rate R burst {BURST} latency {LATENCY} (no qdisc: unlimited); "
        "all of the job's traffic shares that one limit"
    )


def show_window(record: dict, rounds: int) -> None:
    """One progress line per timed window."""
    if record["event"] == "window":
        print(
            f"  {record['backend']:<8} {record['model']:<12} {record['rate']:<10} "
            f"round {record['round']}/{rounds}  {record['compressor']:<9} "
            f"{record['ms_per_step']:9.1f} ms/step",
            flush=True,
        )


def throughput_jobs(args: argparse.Namespace, shaped: bool, tmp: str, rows: list) -> None:
    """Run a job per (backend, model, rate), printing each window; append result rows."""
    jobs = [(b, m, r) for b in args.backend for m in args.models for r in args.rates]
    for number, (backend, model, rate) in enumerate(jobs, 1):
        print(
            f"[job {number}/{len(jobs)}] {backend} {model} {rate}: {args.np} processes", flush=True
        )
        results = os.path.join(tmp, f"job{number}.jsonl")
        # each backend runs the compressors and its own probes
        names = [c for c in args.compressors if c not in PROBES or c in BACKEND_PROBES[backend]]
        batch = BATCH[model] if args.batch is None else args.batch
        worker_args = [
            *("--backend", backend, "--model", model, "--rate", rate, "--results", results),
            *("--compressors", ",".join(names), "--batch", str(batch)),
            *("--image-size", str(args.image_size), "--warmup", str(args.warmup)),
            *("--momentum", str(args.momentum)),
            *(() if args.bucket_bytes is None else ("--bucket-bytes", str(args.bucket_bytes))),
            *("--rounds", str(args.rounds), "--window", str(args.window)),
            *("--threads", str(args.threads), "--timeout", str(args.timeout)),
            *("--auto-interval", str(args.auto_interval)),
        ]
        with link(rate, shaped) as prefix:
            if backend == "horovod":
                command = horovod_command(prefix, args.np, "benchmarks.network.worker", worker_args)
            else:
                command = mwms_command(prefix, args.np, args.timeout, worker_args)
            log = os.path.join(tmp, f"job{number}.log")
            records = run_job(
                command,
                results,
                log,
                args.timeout + 60,
                lambda r: show_window(r, args.rounds),
                pin=args.pin,
            )
        rows += [r for r in records if r["event"] == "result"]


def accuracy_job(args: argparse.Namespace, shaped: bool, tmp: str, records: list) -> None:
    """The time-to-target job under horovodrun, printing each epoch; append its records."""
    (rate,), (name,) = args.rates, args.models
    results = os.path.join(tmp, "accuracy.jsonl")
    worker_args = [
        *("--task", name, "--compressors", ",".join(args.compressors)),
        *("--rate", rate, "--results", results),
        *("--epochs", str(args.epochs), "--batch", str(args.batch)),
        *("--auto-interval", str(args.auto_interval)),
    ]

    def progress(record: dict) -> None:
        if record["event"] == "epoch":
            print(
                f"  {rate:<10} epoch {record['epoch']:>3}  step {record['step']:>5}  "
                f"{record['compressor']:<9} {record['seconds']:8.1f} s  "
                f"{TASKS[name].metric} {record['score']:.4f}",
                flush=True,
            )

    print(f"[accuracy] {name}, horovod, {args.np} processes, {rate}", flush=True)
    with link(rate, shaped) as prefix:
        command = horovod_command(
            prefix, args.np, "benchmarks.network.accuracy_worker", worker_args
        )
        log = os.path.join(tmp, "accuracy.log")
        records += run_job(command, results, log, args.timeout, progress, pin=args.pin)


def cores_note(args: argparse.Namespace) -> str:
    """How the job's processes share the machine's cores, for the report."""
    cores = len(os.sched_getaffinity(0))
    if not args.pin:
        return f"all {cores} cores shared by the {args.np} processes of a job (--no-pin)"
    if cores < args.np:
        return f"not pinned: {cores} cores for {args.np} processes"
    share = cores // args.np
    return f"each of a job's {args.np} processes pinned to its own {share} of the {cores} cores"


def timing_note(args: argparse.Namespace) -> str:
    if args.mode == "accuracy":
        return (
            "compressors take turns epoch by epoch in one job; each one's clock runs only during "
            f"its own training steps (tracing included, evaluation excluded); {cores_note(args)}"
        )
    return (
        f"ms/step: best of {args.rounds} windows of {args.window} steps after {args.warmup} "
        "warm-up steps, each window timed by its slowest process; the compressors take turns "
        "window by window inside one job per (backend, model, rate); ×dense = dense ms / this "
        f"ms (> 1: faster than dense), ×FP16 likewise; {cores_note(args)}; lockstep floor: each "
        "process times every step of a window (to its loss read back, which every step does "
        "anyway; nothing is added between processes inside the window), the step times are "
        "gathered after the window, and the floor is the mean over steps of the slowest "
        "process's step (best window): what steps that each wait for the slowest process cost "
        "at least, given the processes' per-step jitter"
    )


def write(args: argparse.Namespace, records: list, note: str, complete: bool) -> None:
    """Print the table and write the output files."""
    data = {"settings": {k: v for k, v in vars(args).items() if k != "out"}}
    data.update(network=note, timing=timing_note(args), complete=complete)
    if args.mode == "throughput":
        data["rows"] = rows = report.with_ratios(records)
        table = report.throughput_markdown(rows, args.rates, args.compressors)
        table += report.floor_markdown(rows, args.rates)
        table += report.overlap_markdown(rows, args.rates)
        table += report.fit_markdown(rows, args.rates)
    else:
        data["records"] = records
        task = TASKS[args.models[0]]
        table = report.accuracy_markdown(records, task, args.target)
        title = f"{task.title}, {args.np} Horovod ranks, {args.rates[0]}"
        report.plot_accuracy(records, task, args.target, title, args.out + ".png")
    markdown = f"{table}\nNetwork: {note}.\n\nTiming: {data['timing']}.\n"
    print("\n" + markdown, flush=True)
    for path in report.write_outputs(args.out, markdown, data):
        print(f"wrote {path}")
    if args.mode == "accuracy":
        print(f"wrote {args.out}.png")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM as Ctrl-C: unwinds through the cleanup of jobs and namespaces.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if ("horovod" in args.backend or args.mode == "accuracy") and not find_spec("horovod"):
        print("Horovod is not installed: build it with `make horovod`.", file=sys.stderr)
        return 2
    shaped, note = plan_network(args)
    records, failure, complete = [], "", False
    with tempfile.TemporaryDirectory(prefix="network_bench_") as tmp:
        try:
            run = throughput_jobs if args.mode == "throughput" else accuracy_job
            run(args, shaped, tmp, records)
            complete = True
        except JobFailed as error:
            failure = f"FAILED: {error}"
        except KeyboardInterrupt:  # jobs and namespaces are already cleaned up
            failure = "interrupted"
        if records:  # what finished is written, also after a failure or Ctrl-C
            write(args, records, note, complete)
    if failure:
        print(failure, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
