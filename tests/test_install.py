"""``pip install .`` (not editable) from a clean checkout gives compiled kernels.

A fresh virtual environment installs the package from a copy of the checkout's files (tracked
and untracked-but-not-ignored, so no build outputs), pinned by constraints.txt; it borrows this
environment's TensorFlow, Keras and NumPy through a ``.pth`` file (as ``test_wheel.py`` does),
which satisfy the pins, so pip builds and installs tf_sparsify alone (``make setup`` installs
tensorflow-cpu from the registry with the same constraints). Then ``python -m
tf_sparsify.ops.build`` and ``python -m tf_sparsify info`` run from outside the checkout, so
they see only the installed package (the kernels compiled from source). About a minute on two
cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.processes  # venvs, pip installs, sdist and wheel builds

ROOT = Path(__file__).resolve().parents[1]


def run_ok(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> str:
    """Runs ``cmd``; its stdout, or a failure showing the ends of its output."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _copy_checkout(dest: Path) -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def test_pip_install_from_checkout_builds_and_loads_kernels(tmp_path):
    checkout, venv, work = tmp_path / "checkout", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    _copy_checkout(checkout)
    assert not list(checkout.rglob("*.so")), "build outputs must not be copied"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TF_SPARSIFY"))}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    # no pip of its own (ensurepip: ~4 s): this pip installs into it (`--python`)
    run_ok([sys.executable, "-m", "venv", "--without-pip", str(venv)], work, env)
    py = str(venv / "bin" / "python")
    venv_site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    (venv_site / "site-packages" / "borrowed.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    constraints = str(checkout / "constraints.txt")
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "-c", constraints]
    run_ok([*pip, f"{checkout}[cpu]"], work, env)

    run_env = {**env, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    # unoptimized: half the compiler time; what is checked is that it builds and loads
    built = run_ok([py, "-m", "tf_sparsify.ops.build"], work, {**run_env, "CXXFLAGS": "-O0"})
    # `python -m tf_sparsify info`, then an op, in one process (one TensorFlow import)
    info_and_topk = (
        "import os, tensorflow as tf, tf_sparsify; from tf_sparsify import ops\n"
        "from tf_sparsify.__main__ import main; main(['info'])\n"
        "v, i, r = ops.topk_error_feedback(tf.constant([1., -5., 2., 0.]), tf.zeros([4]), 2)\n"
        "print(os.path.dirname(tf_sparsify.__file__)); print(i.numpy().tolist())"
    )
    report = run_ok([py, "-c", info_and_topk], work, {**run_env, "TF_SPARSIFY_REQUIRE_OPS": "1"})
    package, selected = report.strip().splitlines()[-2:]
    site = Path(package)
    assert site.is_relative_to(venv), site
    assert str(site / "ops" / "lib" / "_tf_sparsify_ops.so") in built
    assert f"compiled kernels loaded from {site / 'ops' / 'lib'}" in report
    assert "origin: built from source for TensorFlow" in report
    assert "TopKErrorFeedback: CPU" in report and "QSGDQuantize: CPU" in report
    assert selected == "[1, 2]"


KERNEL_SOURCES = ("cc/ops/ops.cc", "cc/kernels/topk_error_feedback_cpu.cc", "cuda/topk.cu")
HOROVOD_INSTALLER = "tf_sparsify/install_horovod.sh"


def test_sdist_and_wheel_carry_the_kernel_sources_and_the_horovod_installer(tmp_path):
    """The checkout keeps its kernels in custom_ops/; the sdist carries that tree (it builds
    from source) and the wheel carries it as tf_sparsify/ops/src/, where the build finds it.
    Both carry the Horovod installer as the checkout has it."""
    installer = (ROOT / HOROVOD_INSTALLER).read_bytes()
    checkout = tmp_path / "checkout"
    _copy_checkout(checkout)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TF_SPARSIFY"))}
    run_ok([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], checkout, env)
    (sdist,) = (tmp_path / "dist").glob("tf_sparsify-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        top = names[0].split("/")[0]
        assert archive.extractfile(f"{top}/{HOROVOD_INSTALLER}").read() == installer
    for source in KERNEL_SOURCES:
        assert f"{top}/custom_ops/{source}" in names
    run_ok(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheels"),
            str(sdist),
        ],
        tmp_path,
        env,
    )
    (wheel,) = (tmp_path / "wheels").glob("tf_sparsify-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert archive.read(HOROVOD_INSTALLER) == installer
    for source in KERNEL_SOURCES:
        assert f"tf_sparsify/ops/src/{source}" in names
    assert not any(name.startswith("custom_ops/") for name in names)


def test_import_leaves_tensorflow_unconfigured():
    """Importing the package starts no TensorFlow context (no eager tensor at import), so users
    can still set up logical devices and MultiWorkerMirroredStrategy's collectives after it."""
    out = run_python(
        """
        import tensorflow as tf
        import tf_sparsify
        import tf_sparsify.keras
        from tf_sparsify.compressors import bits
        cpu = tf.config.list_physical_devices("CPU")[0]
        two = [tf.config.LogicalDeviceConfiguration()] * 2
        tf.config.set_logical_device_configuration(cpu, two)
        print(len(tf.config.list_logical_devices("CPU")))
        """
    )
    assert out.split()[-1] == "2"
