"""The platform wheel of ``make wheel`` (``scripts/build_wheel.py``) carries compiled kernels that
a fresh virtual environment loads with no build step and no compiler; kernels built for another
TensorFlow are refused with the way to build them from source.

The fresh environment borrows this one's TensorFlow, Keras and NumPy through a ``.pth`` file
(nothing is downloaded); only tf_sparsify comes from the wheel. The wheel build reuses the
checkout's kernels when their build info proves them current (``make setup`` built them),
else compiles them once into ``build/kernels/``.
"""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import tensorflow as tf

from tests.test_install import ROOT, run_ok
from tf_sparsify.ops import library, paths

MAJOR, MINOR = (int(part) for part in tf.__version__.split(".")[:2])
TF_RANGE = f">={MAJOR}.{MINOR},<{MAJOR}.{MINOR + 1}"
#: ``python -m tf_sparsify info``, an op, then the loader's verdict on kernels built for another
#: TensorFlow, in one process (one TensorFlow import)
INFO_AND_TOPK = """
import os, sys
import tensorflow as tf
import tf_sparsify
from tf_sparsify import ops
from tf_sparsify.__main__ import main
from tf_sparsify.ops import library
main(["info"])
grad = tf.constant([1.0, -5.0, 2.0, 0.5])
values, indices, residual = ops.topk_error_feedback(grad, tf.zeros([4]), 2)
print(tf_sparsify.__file__)
print(values.numpy().tolist(), indices.numpy().tolist(), residual.numpy().tolist())
os.environ["TF_SPARSIFY_LIB_DIR"] = sys.argv[1]  # a copy built "for" another TensorFlow
print(library.load().reason)
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TF_SPARSIFY"))}


def _build_wheel_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_wheel", ROOT / "scripts/build_wheel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_build(directory: Path, info: dict[str, str | None]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / paths.LIB_NAME).write_bytes(b"never loaded")
    (directory / paths.INFO_NAME).write_text(json.dumps(info))


@pytest.mark.processes
def test_wheel_installs_into_a_fresh_venv_and_loads_its_kernels_without_a_compiler(tmp_path):
    dist, venv, work = tmp_path / "dist", tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    env = {**_clean_env(), "TF_CPP_MIN_LOG_LEVEL": "2"}
    built = run_ok([sys.executable, "scripts/build_wheel.py", "--dist-dir", str(dist)], ROOT, env)
    wheel = Path(built.strip().splitlines()[-1])
    assert wheel.parent == dist and wheel.is_file(), built
    assert re.fullmatch(r"tf_sparsify-[\w.]+-py3-none-manylinux_2_\d+_x86_64\.whl", wheel.name)
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"tf_sparsify-{version}.dist-info/METADATA").decode()
        packaged = json.loads(archive.read(f"tf_sparsify/ops/lib/{paths.INFO_NAME}"))
    assert f'Requires-Dist: tensorflow-cpu{TF_RANGE}; extra == "cpu"' in metadata
    assert f'Requires-Dist: tensorflow{TF_RANGE}; extra == "gpu"' in metadata
    assert packaged["tensorflow"] == tf.__version__ and packaged["wheel"] == version
    assert packaged["sources"] == paths.sources_fingerprint()
    (sdist,) = dist.glob("tf_sparsify-*.tar.gz")  # sources only, the broad ranges
    with tarfile.open(sdist) as archive:
        assert not any(name.endswith(".so") for name in archive.getnames())
        top = archive.getnames()[0].split("/")[0]
        requires = archive.extractfile(f"{top}/tf_sparsify.egg-info/requires.txt").read()
    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(ROOT / "setup.cfg")
    for extra in ("cpu", "gpu"):  # as setup.cfg has them
        broad = setup_cfg["options.extras_require"][extra].strip()
        assert f"[{extra}]\n{broad}\n" in requires.decode()

    run_ok([sys.executable, "-m", "venv", "--without-pip", str(venv)], work, env)
    python = str(venv / "bin" / "python")
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = site / "site-packages"
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index"]
    run_ok([*pip, f"{wheel}[cpu]"], work, env)  # tensorflow-cpu: the borrowed one fits the pin

    lib_dir = site / "tf_sparsify" / "ops" / "lib"
    other = tmp_path / "built_for_another_tensorflow"
    shutil.copytree(lib_dir, other)
    other_tf = f"{MAJOR}.{MINOR + 1}.0"
    (other / paths.INFO_NAME).write_text(json.dumps({**packaged, "tensorflow": other_tf}))
    no_compiler = {**env, "PATH": str(venv / "bin"), "CC": "/bin/false", "CXX": "/bin/false"}
    required = {**no_compiler, "TF_SPARSIFY_REQUIRE_OPS": "1"}
    report = run_ok([python, "-c", INFO_AND_TOPK, str(other)], work, required)
    module, values, reason = report.splitlines()[-3:]
    assert f"compiled kernels loaded from {lib_dir}\n" in report, report
    assert f"origin: packaged in the tf_sparsify {version} wheel for TensorFlow" in report
    assert "TopKErrorFeedback: CPU" in report
    assert not (lib_dir / "build").exists()  # nothing was compiled there

    installer = site / "tf_sparsify" / "install_horovod.sh"  # the wheel's, as the checkout's
    assert installer.read_bytes() == (ROOT / "tf_sparsify" / "install_horovod.sh").read_bytes()
    dry_run = [python, "-m", "tf_sparsify", "install-horovod", "--dry-run"]
    proc = subprocess.run(
        dry_run, cwd=work, env={**env, "HOROVOD_REINSTALL": "1"}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = proc.stderr.splitlines()[-1]  # this venv's interpreter, never the checkout's
    assert plan.startswith(f"[install_horovod] dry run ({installer}): would "), plan
    assert plan.endswith(f"install it with {python} into {venv}"), plan

    assert Path(module).is_relative_to(site), module
    assert values == "[-5.0, 2.0] [1, 2] [1.0, 0.0, 0.0, 0.5]"
    assert reason == (
        f"the compiled kernels in {other} (packaged in the tf_sparsify {version} wheel) were "
        f"built for TensorFlow {other_tf}, this is {tf.__version__}: run `python -m "
        "tf_sparsify.ops.build` to build them from source (needs a C++ compiler and "
        f"TensorFlow's headers), or install a tf_sparsify wheel built for TensorFlow "
        f"{MAJOR}.{MINOR}"
    )


def test_wheel_build_reuses_only_a_build_of_the_current_sources_for_this_tensorflow(tmp_path):
    script = _build_wheel_script()
    current = {"tensorflow": tf.__version__, "sources": paths.sources_fingerprint(), "cuda": None}
    for stale in ({"sources": "0" * 64}, {"tensorflow": f"{MAJOR}.{MINOR}.99"}):
        _fake_build(tmp_path, {**current, **stale})
        assert script._current(tmp_path, tf.__version__, current["sources"]) is None
    _fake_build(tmp_path, current)
    assert script._current(tmp_path, tf.__version__, current["sources"]) == current
    _fake_build(tmp_path, {**current, "cuda": "12.5"})  # its GPU library is missing
    assert script._current(tmp_path, tf.__version__, current["sources"]) is None


def test_kernels_fit_every_patch_release_of_their_tensorflow_minor_version(monkeypatch, tmp_path):
    """The wheel's pin (>=2.21,<2.22) and the loader agree: another patch release is taken,
    another minor version is refused with how to build from source."""
    monkeypatch.setenv(paths.LIB_DIR_ENV, str(tmp_path))
    _fake_build(tmp_path, {"tensorflow": f"{MAJOR}.{MINOR}.99", "wheel": "9.9.9"})
    directory, build, reason = library.find(tf.__version__)
    assert directory == tmp_path and build["wheel"] == "9.9.9" and reason == ""
    _fake_build(tmp_path, {"tensorflow": f"{MAJOR}.{MINOR + 1}.3"})
    directory, build, reason = library.find(tf.__version__)
    assert directory is None and build is None
    built_for = f"in {tmp_path} (built from source) were built for TensorFlow {MAJOR}.{MINOR + 1}.3"
    assert built_for in reason
    assert reason.endswith(f"or install a tf_sparsify wheel built for TensorFlow {MAJOR}.{MINOR}")


def test_missing_kernels_say_how_to_build_them(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.LIB_DIR_ENV, str(tmp_path))
    reason = library.load().reason
    assert reason.startswith(f"no compiled kernels ({paths.LIB_NAME}) in {tmp_path}: run `python")
    assert "needs a C++ compiler and TensorFlow's headers" in reason
