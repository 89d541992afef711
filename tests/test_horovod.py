"""Horovod front end, under ``horovodrun -np 2 --gloo`` (launched from here).

Few launches, each batching several checks (a launch costs ~15 s of start-up on 2 cores). One
2-rank launch runs four workers one after another (``horovod_workers/suite.py``):
``exact.py`` (updates against a hand computation, bytes moved against ``wire_bytes``, Identity
against plain Horovod averaging, Horovod ``compression=`` classes, broadcast and
metric-averaging callbacks), ``restart.py`` (one checkpoint by rank 0 restores every rank),
``sparse_rows.py`` (IndexedSlices) and ``mismatch.py`` (ranks configured differently fail at
the first step, fast). Then ``horovod_workers/hierarchy.py`` (the hierarchical exchange on 4
ranks as 2 "nodes" of 2: updates, residuals and bytes against a hand computation,
conservation, Identity, bad input, mismatches), ``horovod_workers/late_resume.py`` (fresh
processes resume from the checkpoint ``restart.py`` wrote with gradients in flight), the two
examples (TopK + EF converges on digits, under ``model.fit`` and in a custom loop) and the
elastic jobs. The workers print one
``RESULT {json}`` line per check and rank, naming their worker; these tests assert on them.
Nothing is skipped:
``make test`` builds Horovod first, and a missing Horovod fails with a message that says how
to build it.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

from benchmarks.horovodrun import COMMAND as HOROVODRUN
from tests.script_runner import ROOT, shared_fork_server

pytestmark = pytest.mark.processes  # every test runs under horovodrun or needs Horovod built

WORKERS = os.path.join(ROOT, "tests", "horovod_workers")
#: what horovodrun starts per rank: a fork of one warm interpreter (see that file)
FORKED_RANKS = os.path.join(WORKERS, "forked_ranks.py")
SOCKET_ENV = "TF_SPARSIFY_TEST_RANK_SERVER"
TIMEOUT_S = 240
_rank_server: dict[str, str] = {}


def rank_server() -> dict[str, str]:
    """The environment that points ``forked_ranks.py run`` at this test process's server of
    forked ranks, started on first use as a child of :func:`shared_fork_server` (so it skips
    the imports that process has done; it stops when that process does)."""
    if _rank_server:
        return _rank_server
    folder = tempfile.mkdtemp(prefix="ranks")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path, log = os.path.join(folder, "socket"), os.path.join(folder, "server.log")
    answer = shared_fork_server().ask(
        {"script": FORKED_RANKS, "argv": ["serve", path], "output": log, "detach": True}
    )
    server = psutil.Process(answer["pid"])  # the fork server's child: a zombie once it exits
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        exited = server.status() == psutil.STATUS_ZOMBIE
        if exited or time.monotonic() > deadline:
            with open(log, encoding="utf-8", errors="replace") as f:
                why = "exited" if exited else "did not listen within 60 s"
                pytest.fail(f"the rank server {why}:\n{f.read()[-3000:]}")
        time.sleep(0.05)
    _rank_server[SOCKET_ENV] = path
    return _rank_server


def _require_horovod() -> None:
    """Fails, saying how to build it, unless Horovod's TensorFlow library loads and has Gloo
    (what ``horovodrun`` checks at every launch, and :mod:`benchmarks.horovodrun` does not)."""
    try:
        import horovod.tensorflow as hvd
    except ImportError as error:
        pytest.fail(
            f"Horovod is not usable in this environment (`import horovod.tensorflow`: {error}). "
            "Build it with `make horovod` (python -m tf_sparsify install-horovod)."
        )
    if not hvd.gloo_built():
        pytest.fail("Horovod was built without Gloo: rebuild it with `make horovod`.")


def horovodrun(
    script: str,
    *args: str,
    timeout: int = TIMEOUT_S,
    ranks: int = 2,
    options: tuple = (),
    cwd: str = ROOT,
) -> tuple[int, str]:
    """Run ``script`` on ``ranks`` ranks in ``cwd`` (``options``: more of horovodrun's);
    ``(exit code, output)``. Each rank is a fork of a warm interpreter
    (``horovod_workers/forked_ranks.py``), as ``python script`` would run it. A run past
    ``timeout`` (a hang) is killed with everything it started, and the test fails. Horovod's
    background loop wakes every 5 ms (``HOROVOD_CYCLE_TIME``; its default is shorter): on 2
    shared cores the wake-ups cost more CPU than the latency they save."""
    _require_horovod()
    ranks_run = [sys.executable, FORKED_RANKS, "run"]
    command = [*HOROVODRUN, "-np", str(ranks), *options, "--gloo"]
    command += [*ranks_run, script, *args]
    env = {**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2", **rank_server()}
    env.setdefault("HOROVOD_CYCLE_TIME", "5")
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(command)} still running after {timeout} s:\n{out[-6000:]}")
    except BaseException:  # pytest-timeout's failure, ^C: no rank is left running
        kill_tree(proc)
        proc.communicate()
        raise
    return proc.returncode, out


def kill_tree(proc: subprocess.Popen) -> None:
    """Kills ``proc`` and every process it started."""
    try:
        launcher = psutil.Process(proc.pid)
        family = launcher.children(recursive=True) + [launcher]
    except psutil.NoSuchProcess:
        return
    for member in family:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass


def results(out: str, worker: str | None = None) -> dict[str, dict[int, dict]]:
    """``{check: {rank: result}}`` from the workers' ``RESULT`` lines (``worker``'s alone when
    given)."""
    found: dict[str, dict[int, dict]] = {}
    for line in out.splitlines():
        if "RESULT " in line:
            record = json.loads(line.split("RESULT ", 1)[1])
            if worker is None or record.get("worker") == worker:
                found.setdefault(record.get("check", "example"), {})[record.get("rank", 0)] = record
    return found


def _run_workers(script: str, *args: str, ranks: int = 2, timeout: int = TIMEOUT_S) -> str:
    """The output of a launch of worker ``script``; fails when it ended in error with no
    failed check to show for it."""
    code, out = horovodrun(script, *args, ranks=ranks, timeout=timeout)
    found = results(out)
    assert found, f"no results from {script} (exit {code}):\n{out[-6000:]}"
    failed = {k: v for k, r in found.items() for v in r.values() if not v.get("ok", True)}
    assert code == 0 or failed, f"{script} exited {code}:\n{out[-6000:]}"
    return out


def _launch(script: str, *args: str, ranks: int = 2) -> dict[str, dict[int, dict]]:
    return results(_run_workers(script, *args, ranks=ranks))


# The 2-rank workers that share one launch, in their order in it.
SUITE = ("exact", "restart", "sparse_rows", "mismatch")


@pytest.fixture(scope="module")
def suite_output() -> str:
    script = os.path.join(WORKERS, "suite.py")
    return _run_workers(script, *SUITE, timeout=len(SUITE) * TIMEOUT_S)


def _worker_results(out: str, worker: str) -> dict[str, dict[int, dict]]:
    found = results(out, worker)
    assert found, f"no results from {worker} in the shared launch:\n{out[-6000:]}"
    return found


@pytest.fixture(scope="module")
def exact(suite_output) -> dict[str, dict[int, dict]]:
    return _worker_results(suite_output, "exact")


@pytest.fixture(scope="module")
def mismatch(suite_output) -> dict[str, dict[int, dict]]:
    return _worker_results(suite_output, "mismatch")


@pytest.fixture(scope="module")
def restart(suite_output) -> dict[str, dict[int, dict]]:
    return _worker_results(suite_output, "restart")


@pytest.fixture(scope="module")
def hierarchy() -> dict[str, dict[int, dict]]:
    return _launch(os.path.join(WORKERS, "hierarchy.py"), ranks=4)


def _passed(found: dict, check: str, ranks: int = 2) -> dict[int, dict]:
    assert check in found, f"check {check!r} did not run; ran {sorted(found)}"
    per_rank = found[check]
    assert sorted(per_rank) == list(range(ranks)), f"{check}: results from {sorted(per_rank)}"
    for rank, record in per_rank.items():
        assert record["ok"], f"{check} failed on rank {rank}: {record.get('error')}\n" + record.get(
            "traceback", ""
        )
    return per_rank


CONFIGS = [
    "topk_ef_min_size",
    "topk_global",
    "randomk",
    "qsgd_int8",
    "qsgd_int16",
    "terngrad_uint8",
    "sign_ef",
    "bf16_ef",
    "fp16",
    "identity",
]


# Horovod ops of one traced step per config (one bucket): grouped all-reduces and grouped
# all-gathers; the first-step plan check adds one HorovodAllgather in a branch.
STEP_OPS = {
    "topk_ef_min_size": (1, 1),  # tensors under min_size go dense
    "topk_global": (0, 1),
    "randomk": (1, 0),  # shared coordinates: values are summed
    "qsgd_int8": (0, 1),
    "qsgd_int16": (0, 1),
    "terngrad_uint8": (0, 1),
    "sign_ef": (0, 1),
    "bf16_ef": (0, 1),
    "fp16": (1, 0),
    "identity": (1, 0),
}


@pytest.mark.parametrize("config", CONFIGS)
def test_a_step_makes_one_collective_per_kind_whatever_the_payload_dtypes(exact, config):
    """A bucket's payload (values, indices or codes, scales: up to three dtypes) travels in one
    grouped all-gather: every Horovod op pays its own negotiation round and transfer."""
    reduces, gathers = STEP_OPS[config]
    want = {"HorovodAllgather": 1}
    want.update({"HorovodGroupedAllreduce": reduces} if reduces else {})
    want.update({"HorovodGroupedAllgather": gathers} if gathers else {})
    for record in _passed(exact, f"update_{config}").values():
        assert record["horovod_ops"] == want


@pytest.mark.parametrize("config", CONFIGS)
def test_update_is_mean_of_decompressed_payloads_and_bytes_match(exact, config):
    """Optimizer and GradientExchange: update == mean_p decompress(compress(g_p + e_p)) over 2
    steps, residuals as by hand, and the bytes handed to Horovod == bytes_sent == wire bytes."""
    for record in _passed(exact, f"update_{config}").values():
        assert (
            record["bytes_to_horovod"] == record["bytes_sent"] == 2 * record["wire_bytes_per_step"]
        )
        if config not in ("identity",):
            assert record["wire_bytes_per_step"] < record["dense_bytes_per_step"]


def test_powersgd_update_matches_numpy_and_bytes_match(exact):
    """PowerSGD(2): the update approximates the mean over ranks as NumPy computes it, residual
    and Q as by hand, and the bytes handed to Horovod are the wire bytes (P and Q, flat in the
    ranks, plus the tensors sent dense)."""
    for record in _passed(exact, "update_powersgd").values():
        assert record["wire_bytes_per_step"] < record["dense_bytes_per_step"]


def test_late_buckets_apply_the_synchronous_updates_one_step_later(exact):
    """``late_buckets="all"`` under Horovod (optimizer in a tf.function, and the custom-loop
    exchange): step t applies the reference's update of step t - 1, the flush the last one;
    the late bucket is still one grouped collective per payload kind, as synchronously."""
    reduces, gathers = STEP_OPS["topk_ef_min_size"]
    want = {"HorovodAllgather": 1, "HorovodGroupedAllreduce": reduces}
    want["HorovodGroupedAllgather"] = gathers
    for record in _passed(exact, "late_buckets").values():
        assert record["horovod_ops"] == want


def test_exchange_checkpoint_restores_residuals_and_step(exact):
    _passed(exact, "exchange_checkpoint")


def test_the_link_probe_measures_one_link_for_every_rank(exact):
    """``measure_link`` through Horovod's all-reduce: every rank holds the same times (averaged
    over the ranks), a link fits them, and ``probe-link --out`` wrote them (checked on rank 0)."""
    ranks = _passed(exact, "probe_link")
    assert ranks[0]["seconds"] == ranks[1]["seconds"] and len(ranks[0]["seconds"]) == 4
    assert ranks[0]["bandwidth"] > 0


def test_auto_decides_alike_on_every_rank(exact):
    """``AutoCompression`` under Horovod: the link measured through Horovod's all-reduce, the
    same decisions and measured steps on every rank, one decision per interval."""
    ranks = _passed(exact, "auto")
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and ranks[0]["decisions"]
    assert ranks[0]["measured"] == ranks[1]["measured"]
    assert ranks[0]["link_workers"] == 2
    assert len(ranks[0]["decisions"]) == 6  # 12 steps, a decision after every second


def test_tape_with_momentum_correction_equals_the_optimizer(exact):
    """Custom loops get DGC momentum correction too, from the same state core."""
    _passed(exact, "tape_momentum_equals_optimizer")


def test_topk_applied_in_place_equals_the_dense_path(exact):
    """Plain SGD inside: TopK updates go into the variables from the gathered entries."""
    _passed(exact, "sparse_sgd_equals_dense")


def test_identity_equals_plain_horovod_averaging(exact):
    for record in _passed(exact, "identity_equals_horovod_average").values():
        assert record["max_abs_diff"] <= 1e-6


def test_horovod_compression_classes(exact):
    """FP16/BF16/RandomK/TopK as Horovod ``compression=``: values, dtypes, bfloat16 inputs,
    fresh shared random-k indices per call, TopK dense; hvd.DistributedGradientTape takes them."""
    _passed(exact, "compression_classes")


def test_broadcast_and_metric_average_callbacks(exact):
    per_rank = _passed(exact, "callbacks")
    assert per_rank[0]["averaged_loss"] == pytest.approx(per_rank[1]["averaged_loss"])


MISMATCHES = {
    "k": "compressor",
    "compressor": "compressor",
    "dtype": "variable shapes and dtypes",
    "error_feedback": "pipeline options",
    "late_buckets": "pipeline options",
    "k_eager": "compressor",
    "exchange_k": "compressor",
    "exchange_min_size": "pipeline options",
    "powersgd_rank": "compressor",
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_ranks_configured_differently_fail_at_first_step(mismatch, case):
    for rank, record in _passed(mismatch, case).items():
        assert f"differ in their {MISMATCHES[case]}" in record["message"]
        assert f"rank {rank} of 2" in record["message"]


@pytest.mark.parametrize("case", ["none_gradient_topk", "none_gradient_sparse_allreduce"])
def test_ranks_with_different_none_gradients_fail_at_first_step(mismatch, case):
    for record in _passed(mismatch, case).values():
        assert "differ in their variables without a gradient" in record["message"]


def test_restore_on_rank0_then_broadcast_does_not_hang(mismatch):
    """Rank 0 restores a checkpoint written after training, then broadcasts: the plan check
    runs on every rank (it is never checkpointed) and the ranks stay in step."""
    records = _passed(mismatch, "restore_then_broadcast")
    assert records[0]["steps"] == records[1]["steps"] >= 2


@pytest.mark.parametrize(
    "case",
    [
        "keras_gathered_every_rank",
        "keras_gathered_rank0",
        "exchange_gathered_every_rank",
        "exchange_gathered_rank0",
        "keras_late_every_rank",
        "keras_late_rank0",
    ],
)
def test_one_checkpoint_by_rank0_restores_every_rank_exactly(restart, case):
    """After gather_error_memory, rank 0's checkpoint holds both ranks' residuals (and, with
    ``late_buckets``, both ranks' gradients in flight at the save): restored on every rank, or
    on rank 0 and handed out by the broadcast, continuing equals not stopping."""
    for record in _passed(restart, case).values():
        assert record["max_difference"] == 0.0


@pytest.fixture(scope="module")
def late_resumed(restart) -> dict[str, dict[int, dict]]:
    folder = _passed(restart, "keras_late_every_rank")[0]["folder"]
    return _launch(os.path.join(WORKERS, "late_resume.py"), folder)


def test_fresh_processes_resume_the_gradients_in_flight_exactly(late_resumed):
    """A new launch (fresh processes) restores the checkpoint written inside ``fit`` with a
    gradient in flight on each rank, trains the last epoch and ends bit for bit where the run
    that never stopped ended, after as many steps (4 + 4, and the one that applies what is in
    flight)."""
    for record in _passed(late_resumed, "keras_late_fresh_processes").values():
        assert (record["max_difference"], record["iterations"]) == (0.0, 9)


def test_the_broadcast_callback_leaves_each_ranks_gradients_in_flight(restart):
    for record in _passed(restart, "broadcast_keeps_in_flight").values():
        assert record == {**record, "in_flight_kept": True, "weights_from_rank0": True}


@pytest.mark.parametrize("case", ["keras_late_every_rank", "keras_late_rank0"])
def test_the_late_restart_saves_each_ranks_own_gradient_in_flight(restart, case):
    """The late-bucket restart is not vacuous: its checkpoint is written inside ``fit`` (before
    fit's end applies the update in flight) with a non-zero gradient in flight on each rank for
    every variable (the model is one bucket, the last), and the ranks' differ, so a rank
    restored with nothing in flight or with another rank's would not continue exactly. The
    resumed run took as many optimizer steps (4 + 4, and the one that applies what is in flight
    when ``fit`` ends) as the uninterrupted one."""
    records = _passed(restart, case)
    assert all(r["in_flight_variables"] == 4 for r in records.values())
    assert all(r["in_flight_saved"] > 0 for r in records.values())
    assert not records[0]["same_in_flight_as_rank1"] and records[1]["same_in_flight_as_rank1"]
    assert all(r["iterations"] == 9 for r in records.values())


def test_a_keras_file_says_whose_error_memory_it_holds(restart):
    for record in _passed(restart, "keras_file_warns").values():
        assert record["warned"]


def test_a_rank_missing_from_the_checkpoint_is_warned(restart):
    """Without the gather, rank 1 is not fed rank 0's residual: it starts from zero, warned."""
    records = _passed(restart, "keras_rank0_rows_only")
    assert records[1]["warned"] and not records[0]["warned"]


@pytest.mark.parametrize("case", ["set_compressor_on_one_rank", "set_compressor_k_on_one_rank"])
def test_set_compressor_on_one_rank_is_named_not_a_hang(mismatch, case):
    """The plan fingerprint rides in every step's first gather (payloads travel flat, so
    ranks whose sizes drifted apart still reach it): a rank that changed its compressor alone
    (another seed, another k) fails by name, on every rank."""
    for rank, record in _passed(mismatch, case).items():
        assert "differ in their compressor" in record["message"]
        assert f"rank {rank} of 2" in record["message"]


@pytest.mark.parametrize(
    "case", ["apply_in_flight_on_one_rank_last", "apply_in_flight_on_one_rank_all"]
)
def test_apply_in_flight_on_one_rank_is_named_not_a_hang(mismatch, case):
    """With late buckets every step checks the plans first, a step that applies what is in
    flight included: rank 0 applying it while rank 1 trains on fails by name, on both ranks,
    instead of each waiting forever on collectives the other never starts (the last bucket
    late: the steps differ in their collectives; every bucket late: in nothing else)."""
    for rank, record in _passed(mismatch, case).items():
        assert "differ in their step" in record["message"]
        assert f"rank {rank} of 2 has" in record["message"]


def test_mismatch_after_restore_is_named(mismatch):
    for record in _passed(mismatch, "restore_then_mismatch").values():
        assert "differ in their compressor" in record["message"]


def test_matching_ranks_still_train_after_mismatches(mismatch):
    for record in _passed(mismatch, "matching_ranks_still_train").values():
        assert record["exchange_steps"] == 2


@pytest.mark.parametrize(
    "check", ["tape_needs_exchange_for_state", "tape_randomized_needs_exchange", "xla_rejected"]
)
def test_local_value_errors(mismatch, check):
    _passed(mismatch, check)


# -- hierarchical exchange: one launch of 4 ranks as 2 "nodes" of 2 ----------------------------
def test_hierarchical_update_residuals_and_bytes_match_hand_computation(hierarchy):
    """TopK + EF, optimizer and exchange, 3 steps: updates and per-shard residuals as by hand;
    bytes across nodes == bytes_sent == wire bytes, bytes within nodes == (L+1)*shard each."""
    for record in _passed(hierarchy, "update_topk_ef", 4).values():
        assert record["wire_bytes_per_step"] > 0 and record["within_bytes_per_step"] == 336


def test_hierarchical_residuals_conserve_the_gradients(hierarchy):
    for record in _passed(hierarchy, "conservation", 4).values():
        assert record["max_abs_error"] <= 1e-12


def test_hierarchical_identity_equals_plain_horovod_averaging(hierarchy):
    """2 nodes of 2, 4 nodes of 1 and 1 node of 4, with their bytes across and within nodes."""
    _passed(hierarchy, "identity_equals_horovod", 4)


@pytest.mark.parametrize("check", ["bad_input", "init_mismatch", "init"])
def test_hierarchical_setup_and_bad_input(hierarchy, check):
    """ValueErrors naming ranks_per_node (not dividing 4, < 1, not an integer, unregistered,
    ranks asking for different layouts, local_clipnorm, PowerSGD); the registered layout."""
    _passed(hierarchy, check, 4)


@pytest.mark.parametrize("check", ["mismatch_optimizer", "mismatch_exchange"])
def test_hierarchical_mismatch_fails_at_first_step(hierarchy, check):
    for rank, record in _passed(hierarchy, check, 4).items():
        assert f"differ in their ranks_per_node: rank {rank} of 4" in record["message"]


def test_hierarchical_bytes_on_the_test_model(hierarchy):
    """After the mismatches a matching run keeps the ranks in step; TopK 10% sends fewer bytes
    across nodes than the flat exchange."""
    for record in _passed(hierarchy, "model_bytes", 4).values():
        assert record["across_bytes_per_step"] < record["flat_bytes_per_step"]


@pytest.fixture(scope="module")
def digits_examples() -> dict[str, str]:
    """``{example: its rank 0 output}`` of one launch running both digits examples."""
    script = os.path.join(WORKERS, "digits_examples.py")
    code, out = horovodrun(script, "--epochs=12", timeout=2 * TIMEOUT_S)
    assert code == 0, out[-6000:]
    parts = re.split(r"^\[0\]<stdout>:EXAMPLE (\S+)$", out, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.parametrize("example", ["fit", "custom_loop"])
def test_topk_error_feedback_converges_on_digits(digits_examples, example):
    """The examples: TopK 1% + EF, each rank a shard; rank 0 reports accuracy and bytes."""
    assert example in digits_examples, f"{example} did not run; ran {sorted(digits_examples)}"
    out = digits_examples[example]
    assert "rank-0 test accuracy" in out
    (record,) = results(out)["example"].values()
    assert record["accuracy"] > 0.9, record
    assert record["bytes_per_step"] == record["wire_bytes_per_step"]
    assert record["dense_bytes_per_step"] / record["bytes_per_step"] > 40


def test_distributed_optimizer_saves_and_loads_as_keras(tmp_path):
    """Registered for Keras serialization; residuals travel in ``.keras`` files (no Horovod
    collective runs: building and saving need none)."""
    _require_horovod()
    import keras
    import numpy as np

    import tf_sparsify as tfs
    from tf_sparsify.horovod import DistributedOptimizer

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = DistributedOptimizer(keras.optimizers.SGD(0.1), tfs.TopK(k=2), min_size=4)
    model.compile(optimizer=opt, loss="mse")
    opt.build(model.trainable_variables)
    opt.residuals[0].assign(np.full((4, 3), 0.5, "float32"))
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is DistributedOptimizer
    assert loaded.optimizer.get_config() == opt.get_config()
    np.testing.assert_array_equal(loaded.optimizer.residuals[0].numpy(), 0.5)


# -- elastic: a worker is killed, another comes back -------------------------------------------
DISCOVERY = """#!/bin/sh
echo localhost:1
echo 127.0.0.1:1
"""


@pytest.fixture(scope="module", params=["exchange", "keras"])
def elastic(request, tmp_path_factory) -> list[dict]:
    """The ``sync`` records of an elastic job, in order."""
    folder = tmp_path_factory.mktemp(f"elastic_{request.param}")
    script = folder / "discover.sh"
    script.write_text(DISCOVERY)
    script.chmod(0o755)
    options = (
        *("--min-np", "1", "--max-np", "2", "--host-discovery-script", str(script)),
        *("--blacklist-cooldown-range", "1", "2"),
    )
    code, out = horovodrun(
        os.path.join(WORKERS, "elastic.py"), request.param, str(folder), ranks=2, options=options
    )
    records = [
        json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line
    ]
    assert code == 0 and any(r["check"] == "done" for r in records), (
        f"elastic job exited {code}:\n{out[-6000:]}"
    )
    return [r for r in records if r["check"] == "sync"]


def test_a_lost_workers_error_memory_goes_to_the_survivor(elastic):
    """After the kill, the survivor's residuals hold the job's committed total (its own and
    the killed worker's), not its own alone."""
    alone = [r for r in elastic if r["size"] == 1]
    assert alone, elastic
    survivor = alone[0]
    assert survivor["host"] == "localhost"
    assert survivor["residual"] == pytest.approx(survivor["committed_total"], rel=1e-5, abs=1e-6)


def test_a_worker_that_comes_back_starts_from_zero(elastic):
    back = [r for r in elastic if r["size"] == 2 and r["step"] > 0]
    assert {r["host"] for r in back} == {"localhost", "127.0.0.1"}, elastic
    newcomer = next(r for r in back if r["host"] == "127.0.0.1")
    assert newcomer["residual"] == 0.0
    assert all(r["weights_equal"] for r in back)


@pytest.fixture(scope="module")
def sparse_rows(suite_output) -> dict[str, dict[int, dict]]:
    return _worker_results(suite_output, "sparse_rows")


@pytest.mark.parametrize(
    "check",
    [
        "identity_rows",
        "topk_rows_conserve",
        "cast_rows_conserve",
        "embedding_fit",
        "sparse_on_one_rank",
    ],
)
def test_sparse_gradients_travel_as_rows(sparse_rows, check):
    """IndexedSlices under Horovod (tests/horovod_workers/sparse_rows.py): Identity's update
    is every rank's rows, equal to the dense path; TopK and BF16 over touched rows match the
    NumPy model and conserve; model.fit on an embedding keeps the ranks in step; a gradient sparse
    on one rank and dense on the other is a named error."""
    _passed(sparse_rows, check)
