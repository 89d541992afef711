"""Keras 3 ``model.fit``/``evaluate``/``predict`` under MultiWorkerMirroredStrategy: two real
worker processes (forks of a warm interpreter, each with its ``TF_CONFIG``), against
MirroredStrategy on two devices of one process with the same global batches, and through a
worker killed mid-epoch and relaunched."""

from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import run_python
from tests.script_runner import (
    ROOT,
    ForkServer,
    run_forked,
    run_forked_workers,
    shared_fork_server,
)
from tf_sparsify.distribute.multiworker import free_ports, tf_config

WORKER = os.path.join(ROOT, "tests", "multiworker_workers", "fit.py")
ENV = {"PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"}


TIMEOUT_S = 240


@pytest.fixture(scope="module")
def forks() -> ForkServer:
    """A warm interpreter whose forks run the worker (``tests/fork_server.py``): each worker
    process skips the ~4 s of importing TensorFlow, Keras and tf_sparsify."""
    return shared_fork_server()


def launch(forks: ForkServer, out, *args: str, workers: int = 2) -> list[str]:
    """The outputs of ``workers`` MultiWorkerMirroredStrategy workers running the worker script
    (forks, each with its ``TF_CONFIG``), as ``run_local_workers`` runs them: when one fails or
    the time runs out the others are killed, and a RuntimeError (TimeoutError) shows them."""
    ports = free_ports(workers)
    env = [{"TF_CONFIG": tf_config(ports, i), "CUDA_VISIBLE_DEVICES": ""} for i in range(workers)]
    argv = [f"--out={out}", *map(str, args)]
    codes, timed_out, outputs = run_forked_workers(WORKER, argv, env, TIMEOUT_S)
    if any(code != 0 for code in codes):
        report = "\n".join(
            f"--- worker {i} (exit {c}):\n{o[-3000:]}"
            for i, (c, o) in enumerate(zip(codes, outputs, strict=True))
        )
        if timed_out:
            raise TimeoutError(f"workers did not finish within {TIMEOUT_S} s\n{report}")
        raise RuntimeError(f"a worker failed\n{report}")
    return outputs


def mirrored(forks: ForkServer, out, *args: str) -> None:
    """The same job in one process (a fork) on a 2-replica MirroredStrategy."""
    log = os.path.join(out, "mirrored.log")
    argv = [f"--out={out}", "--strategy=mirrored", *args]
    answer = forks.ask({"script": WORKER, "argv": argv, "output": log, "timeout": TIMEOUT_S})
    with open(log, encoding="utf-8", errors="replace") as f:
        assert answer["returncode"] == 0, f.read()[-5000:]


def result(out, config: str, worker: int) -> tuple[dict, dict]:
    with np.load(os.path.join(out, f"{config}_{worker}.npz")) as data:
        arrays = {k: data[k] for k in data.files}
    with open(os.path.join(out, f"{config}_{worker}.json")) as f:
        return arrays, json.load(f)


def weights(arrays: dict) -> list[np.ndarray]:
    return [arrays[f"w{i}"] for i in range(sum(k.startswith("w") for k in arrays))]


def forward(ws: list[np.ndarray], x: np.ndarray) -> np.ndarray:
    return np.maximum(x @ ws[0] + ws[1], 0.0) @ ws[2] + ws[3]


#: what the shared launches train, one after another: TopK and Identity on NumPy arrays, and
#: TopK on a tf.data.Dataset
#: what both jobs train; the workers also train ``auto`` (its decisions follow each job's timing,
#: so it has no MirroredStrategy twin to compare with)
CONFIGS = "--configs=topk,identity,topk_dataset"


@pytest.fixture(scope="module")
def numpy_runs(tmp_path_factory, forks):
    """``CONFIGS`` on two workers (each writing the chief's checkpoint and restoring it, the
    chief alone saving a ``.keras`` file), and on MirroredStrategy on two devices."""
    mw, mirror = tmp_path_factory.mktemp("mw"), tmp_path_factory.mktemp("mirrored")
    launch(forks, mw, CONFIGS + ",auto", "--chief-checkpoint", "--chief-save")
    mirrored(forks, mirror, CONFIGS)
    return mw, mirror


@pytest.mark.processes
@pytest.mark.parametrize("config", ["topk", "identity", "auto"])
def test_workers_end_identical_with_global_history(numpy_runs, config):
    """``auto``: the workers measure the link and the step together and decide alike (each
    change of setting retraces the step on both)."""
    mw, _ = numpy_runs
    (a0, h0), (a1, h1) = result(mw, config, 0), result(mw, config, 1)
    for w0, w1 in zip(weights(a0), weights(a1), strict=True):
        np.testing.assert_array_equal(w0, w1)
    assert h0 == h1 and len(h0["loss"]) == 2
    assert h0["loss"][1] < h0["loss"][0]


@pytest.mark.processes
@pytest.mark.parametrize("config", ["topk", "identity"])
def test_two_workers_equal_mirrored_strategy_on_two_devices(numpy_runs, config):
    mw, mirror = numpy_runs
    (got, history), (want, want_history) = result(mw, config, 0), result(mirror, config, 0)
    initial_gap = max(np.abs(w).max() for w in weights(want))
    assert initial_gap > 0
    for g, w in zip(weights(got), weights(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"], want_history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history["mae"], want_history["mae"], rtol=1e-5)


@pytest.mark.processes
def test_each_worker_keeps_its_own_residual(numpy_runs):
    mw, mirror = numpy_runs
    (a0, _), (a1, _), (m, _) = (
        result(mw, "topk", 0),
        result(mw, "topk", 1),
        result(mirror, "topk", 0),
    )
    # the first kernel's residual is saved as [1, 20, 16] per worker and [2, 20, 16] for the
    # two replicas of MirroredStrategy; worker i holds replica i's residual
    key = next(k for k in a0 if k.startswith("o") and a0[k].shape[1:] == (20, 16))
    r0, r1, both = a0[key], a1[key], m[key]
    assert r0.shape[0] == r1.shape[0] == 1 and both.shape[0] == 2
    assert np.abs(r0 - r1).max() > 1e-4
    np.testing.assert_allclose(np.concatenate([r0, r1]), both, rtol=1e-5, atol=1e-6)


@pytest.mark.processes
def test_evaluate_and_predict_are_global(numpy_runs):
    mw, _ = numpy_runs
    arrays, _ = result(mw, "topk", 0)
    from tests.multiworker_workers.fit import make_data

    x, y = make_data()
    ws = weights(arrays)
    np.testing.assert_allclose(arrays["predictions"], forward(ws, x[:100]), rtol=1e-5, atol=1e-6)
    mse = float(np.mean((forward(ws, x) - y) ** 2))
    np.testing.assert_allclose(arrays["evaluation"][0], mse, rtol=1e-5)


@pytest.mark.processes
def test_dataset_input_is_sharded_over_workers(numpy_runs):
    mw, mirror = numpy_runs
    (got, history), (want, _) = result(mw, "topk_dataset", 0), result(mirror, "topk_dataset", 0)
    for g, w in zip(weights(got), weights(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert history == result(mw, "topk_dataset", 1)[1]


@pytest.mark.processes
def test_plain_keras_needs_the_opt_in(tmp_path, forks):
    """One job: plain Keras fails, then after enable_multi_worker_fit() it trains."""
    outputs = launch(forks, tmp_path, "--configs=plain,enable,plain", "--epochs=1")
    for output in outputs:
        assert "FIT FAILED plain" in output, output[-2000:]
        assert output.index("FIT FAILED plain") < output.index("plain done"), output[-2000:]
    (a0, h0), (a1, h1) = result(tmp_path, "plain", 0), result(tmp_path, "plain", 1)
    assert h0 == h1
    for w0, w1 in zip(weights(a0), weights(a1), strict=True):
        np.testing.assert_array_equal(w0, w1)


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, forks):
    """Four epochs of TopK on two workers, never stopped."""
    out = tmp_path_factory.mktemp("straight")
    launch(forks, out, "--configs=topk", "--epochs=4")
    return out


BACKED_UP = ("--configs=topk", "--epochs=4")


@pytest.fixture(scope="module")
def killed_backups(tmp_path_factory, forks):
    """``workers -> backup folder`` of a TopK job of that many workers whose last worker was
    killed in the middle of epoch 2 (each test resumes from a copy)."""
    made = {}

    def killed(workers: int):
        if workers not in made:
            root = tmp_path_factory.mktemp(f"killed{workers}")
            with pytest.raises(RuntimeError, match=r"exit -9"):
                launch(
                    forks,
                    root,
                    *BACKED_UP,
                    f"--backup={root / 'bk'}",
                    "--kill-at=2:3",
                    f"--kill-worker={workers - 1}",
                    workers=workers,
                )
            made[workers] = root / "bk"
        return made[workers]

    return killed


def _resume_from_copy(source, tmp_path):
    backup = tmp_path / "bk"
    shutil.copytree(source, backup)
    return backup


@pytest.mark.processes
@pytest.mark.parametrize(
    "kill, epochs_again",
    [(None, 2), ("--kill-before-backup=1", 3), ("--kill-in-backup=1", 3)],
    ids=["mid_epoch", "before_its_backup", "inside_its_backup"],
)
def test_backup_and_restore_after_a_worker_is_killed(
    tmp_path, forks, straight_run, killed_backups, kill, epochs_again
):
    """Worker 1 dies mid-epoch, or at an epoch's end after worker 0 wrote its backup (before
    its own, or with its weights file written and no metadata): both resume from the newest
    backup both completed and end equal to the run that never stopped."""
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    if kill is None:
        backup = _resume_from_copy(killed_backups(2), tmp_path)
    else:
        backup = tmp_path / "bk"
        with pytest.raises(RuntimeError, match=r"exit -9"):
            launch(forks, resumed, *BACKED_UP, f"--backup={backup}", kill)
    saved = sorted(p.name for p in (backup / "topk").iterdir())
    assert saved == ["worker_0", "worker_1"]
    outputs = launch(forks, resumed, *BACKED_UP, f"--backup={backup}")
    assert all("topk done" in o for o in outputs)
    for worker in (0, 1):
        (got, history), (want, _) = (
            result(resumed, "topk", worker),
            result(straight_run, "topk", worker),
        )
        assert len(history["loss"]) == epochs_again
        for key in want:
            if key.startswith(("w", "o")):
                np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7, err_msg=key)
    assert not (backup / "topk").exists()  # every worker's backup removed once training ends


def test_the_restore_point_is_the_newest_step_every_worker_of_its_job_holds():
    from tf_sparsify.keras.backups import _restore_point

    two, one = {"workers": 2}, {"workers": 1}
    assert _restore_point({0: {8: two, 16: two}, 1: {8: two}})[0] == 8
    # a 1-worker job went on from a 2-worker job's backup: its own are newer and complete
    assert _restore_point({0: {16: two, 24: one, 32: one}, 1: {8: two, 16: two}})[0] == 32
    assert _restore_point({0: {8: two}}) is None and _restore_point({1: {8: two}}) is None


def _job_total(arrays: list[np.ndarray]) -> np.ndarray:
    """The sum over every row of a job of the first kernel's residual (shape 20 x 16)."""
    return sum(a.reshape(-1, 20, 16).sum(0) for a in arrays)


def _residual_key(arrays: dict, prefix: str) -> str:
    """The key of the first kernel's residual among the optimizer's values saved with ``prefix``."""
    return f"{prefix}{arrays['residual_indexes'][0]}"


@pytest.mark.processes
@pytest.mark.parametrize(
    "before, after, strategy",
    [(2, 1, "mwms"), (2, 1, "none"), (1, 2, "mwms"), (2, 3, "mwms")],
    ids=["2_to_1", "2_to_no_strategy", "1_to_2", "2_to_3"],
)
def test_a_relaunch_with_another_worker_count_resumes_and_conserves(
    tmp_path, forks, killed_backups, before, after, strategy
):
    """The job resumes at the saved epoch (not from epoch 0), each worker with an even share
    of every residual total of the saved job, and each says so once."""
    kept = killed_backups(before)
    backup, resumed = _resume_from_copy(kept, tmp_path), tmp_path / "resumed"
    resumed.mkdir()
    outputs = launch(
        forks, resumed, *BACKED_UP, f"--backup={backup}", f"--strategy={strategy}", workers=after
    )
    for output in outputs:
        assert output.count("each error-memory total is conserved") == 1, output[-3000:]
    newest = max(p.name for p in (kept / "topk" / "worker_0").iterdir())
    saved = []
    for worker in range(before):
        path = kept / "topk" / f"worker_{worker}" / newest / "latest.weights.h5"
        with h5py.File(path, "r") as f:
            saved.append({k: f["optimizer/vars"][k][()] for k in f["optimizer/vars"]})
    results = [result(resumed, "topk", w) for w in range(after)]
    key = _residual_key(results[0][0], "")
    restored = [arrays[_residual_key(arrays, "resumed")] for arrays, _ in results]
    assert np.abs(_job_total([s[key] for s in saved])).sum() > 0
    np.testing.assert_allclose(
        _job_total(restored), _job_total([s[key] for s in saved]), rtol=1e-5, atol=1e-6
    )
    for _, history in results:
        assert len(history["loss"]) == 2  # resumed at epoch 2 of 4
    assert not (backup / "topk").exists()


@pytest.mark.processes
def test_the_chiefs_checkpoint_gives_every_worker_its_own_rows(numpy_runs):
    """The chief writes the tf.train.Checkpoint (the other worker a copy elsewhere): it
    holds both workers' residuals, and each worker restores its own."""
    mw, _ = numpy_runs
    rows = []
    for worker in (0, 1):
        arrays, _ = result(mw, "topk", worker)
        for key in arrays:
            if key.startswith("o"):
                np.testing.assert_array_equal(arrays["restored" + key[1:]], arrays[key], key)
        rows.append(arrays[_residual_key(arrays, "o")])
    assert np.abs(rows[0] - rows[1]).max() > 1e-4
    reader = tf.train.load_checkpoint(str(mw / "topk_ckpt"))
    state = next(
        k
        for k in reader.get_variable_to_shape_map()
        if k.endswith("tf_sparsify_optimizer/.ATTRIBUTES/state")
    )
    manifest = json.loads(reader.get_tensor(state)[0])
    assert (manifest["first_row"], manifest["world"]) == (0, 2)


@pytest.mark.processes
def test_chief_alone_saves_and_the_file_loads(numpy_runs):
    # Saving reads each worker's residuals locally: the chief alone can save, no collective.
    mw, _ = numpy_runs
    out = run_python(
        f"""
        import keras, numpy as np, tf_sparsify
        from tests.multiworker_workers.fit import make_data
        model = keras.models.load_model({str(mw / "topk_chief.keras")!r})
        residual = next(v for v in model.optimizer.variables if tuple(v.shape) == (20, 16))
        before = float(np.abs(residual.numpy()).sum())
        x, y = make_data()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        print("RESIDUAL", before, float(np.abs(residual.numpy()).sum()))
        """
    )
    before, after = map(float, out.split("RESIDUAL")[1].split())
    assert before > 0 and after > 0


@pytest.mark.processes
def test_the_fit_example_runs(tmp_path):
    # the launcher in a fork of a warm interpreter; the workers it starts are new processes
    proc = run_forked(os.path.join(ROOT, "examples", "multiworker_fit.py"), ["--epochs=2"], ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "all workers identical" in proc.stdout
    assert "2 workers, topk" in proc.stdout and "epoch 2: loss" in proc.stdout


@pytest.mark.processes
def test_unseeded_shuffled_arrays_warn():
    out = run_python(
        """
        import warnings, numpy as np, tensorflow as tf
        from tf_sparsify.keras import multi_worker
        x = np.zeros((4, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            multi_worker._warn_if_shuffles_may_differ((x,), {})
            multi_worker._warn_if_shuffles_may_differ((x,), {"shuffle": False})
            multi_worker._warn_if_shuffles_may_differ((tf.data.Dataset.range(3),), {})
            tf.random.set_seed(1)
            multi_worker._warn_if_shuffles_may_differ((x,), {})
        print("WARNINGS", len(caught), "set_random_seed" in str(caught[0].message))
        """
    )
    assert "WARNINGS 1 True" in out
