"""Build and load decisions that need no GPU: which nvcc builds the CUDA kernels (the CUDA major
version of TensorFlow), where the libraries go, which one the loader takes, and the load-time
check that the NVIDIA driver can run the GPU kernels (with fake driver versions)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import tensorflow as tf

from tf_sparsify import ops
from tf_sparsify.ops import build, gpu, library, paths

NVCC12 = build.Nvcc(Path("/opt/cuda-12.5/bin/nvcc"), "12.5")
NVCC13 = build.Nvcc(Path("/usr/local/cuda-13.0/bin/nvcc"), "13.0")


def test_nvcc_matching_tensorflows_cuda_major_is_chosen():
    nvcc, why = build.choose_nvcc("12.5.1", [NVCC13, NVCC12], None)
    assert nvcc == NVCC12 and "CUDA 12.5.1" in why


def test_no_matching_nvcc_builds_cpu_only_and_says_why():
    nvcc, why = build.choose_nvcc("12.5.1", [NVCC13], None)
    assert nvcc is None
    assert "no nvcc of CUDA 12.x" in why and "CUDA 13.0" in why
    with pytest.raises(build.BuildError, match="no nvcc of CUDA 12.x"):
        build.choose_nvcc("12.5.1", [NVCC13], "1")


def test_cpu_only_tensorflow_gets_no_gpu_kernels_unless_forced():
    nvcc, why = build.choose_nvcc(None, [NVCC13], None)
    assert nvcc is None and "not a CUDA build" in why
    nvcc, why = build.choose_nvcc(None, [NVCC13], "1")
    assert nvcc == NVCC13 and "only checks the build" in why
    assert build.choose_nvcc("12.5", [NVCC12], "0")[0] is None


def test_nvcc_version_is_read_from_the_compiler(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text(
        "#!/bin/sh\necho 'Cuda compilation tools, release 12.5, V12.5.82'\necho 'Build x'\n"
    )
    fake.chmod(0o755)
    assert build.nvcc_version(fake) == "12.5"
    assert build.cuda_archs(build.Nvcc(fake, "12.5"))[0] == "70"
    assert build.cuda_archs(NVCC13)[0] == "75"


def test_cxxflags_come_after_the_builds_own_and_change_the_command(monkeypatch):
    """``CXXFLAGS=-O0`` overrides the build's ``-O3`` (the compiler takes the last ``-O``), and
    a command with other flags has another stamp, so its objects are rebuilt."""
    source, out = Path("unit.cc"), Path("unit.o")
    monkeypatch.delenv("CXXFLAGS", raising=False)
    plain = build._cxx_job("g++", source, out, ["-DTF"])
    monkeypatch.setenv("CXXFLAGS", "-O0  -g0")
    job = build._cxx_job("g++", source, out, ["-DTF"])
    assert job.command.index("-O0") > job.command.index("-O3") > 0
    assert job.command.index("-g0") > job.command.index("-DTF")
    assert build._stamp(job) != build._stamp(plain)


def test_this_tensorflow_build_is_recorded():
    """build_info.json of the library in use names this TensorFlow and its CUDA choice."""
    lib = ops._library()
    if lib.build is None:
        pytest.skip(f"no compiled library: {lib.reason}")
    assert lib.build["tensorflow"] == tf.__version__
    tf_cuda = tf.sysconfig.get_build_info().get("cuda_version")
    if lib.build["cuda"]:
        assert tf_cuda and lib.build["cuda"].split(".")[0] == str(tf_cuda).split(".")[0]
    else:
        assert lib.build["cuda_reason"]


def test_build_goes_to_a_user_cache_when_the_package_is_read_only(monkeypatch, tmp_path):
    monkeypatch.delenv(paths.LIB_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(paths, "writable", lambda d: False)
    assert paths.build_dir("2.21.0") == tmp_path / "tf_sparsify" / "tf-2.21.0"
    assert paths.search_dirs("2.21.0") == [paths.PACKAGE_LIB_DIR, paths.build_dir("2.21.0")]
    monkeypatch.setenv(paths.LIB_DIR_ENV, str(tmp_path / "mine"))
    assert paths.build_dir("2.21.0") == paths.search_dirs("2.21.0")[0] == tmp_path / "mine"


def _fake_build(directory: Path, tf_version: str, cuda: str | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / paths.LIB_NAME).write_bytes(b"not a library")
    info = {"tensorflow": tf_version, "cuda": cuda, "cuda_archs": ["75", "80", "90"]}
    (directory / paths.INFO_NAME).write_text(json.dumps(info))


def test_loader_refuses_a_library_built_for_another_tensorflow(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.LIB_DIR_ENV, str(tmp_path))
    _fake_build(tmp_path, "2.20.0")
    lib = library.load()
    assert lib.module is None
    assert "built for TensorFlow 2.20.0" in lib.reason and tf.__version__ in lib.reason
    (tmp_path / paths.INFO_NAME).unlink()
    assert "built for TensorFlow (unknown)" in library.load().reason


@pytest.mark.parametrize(
    "driver,capabilities,problem",
    [
        (12040, [(9, 0)], None),  # minor-version compatibility within CUDA 12
        (12000, [(8, 6), (8, 9)], None),  # sm_80 SASS runs on 8.x
        (12080, [(12, 0)], None),  # PTX of sm_90 JIT-compiles for newer GPUs
        (11080, [(9, 0)], "supports CUDA 11.8"),
        (None, [], "no NVIDIA driver"),
        (12040, [(7, 0)], "compute capability 7.0 is not covered"),
    ],
)
def test_driver_check(driver, capabilities, problem):
    found = gpu.gpu_kernels_problem("12.5", ["75", "80", "90"], driver, capabilities)
    assert found is None if problem is None else problem in found


def test_old_driver_leaves_gpu_kernels_unloaded_with_one_warning(tmp_path):
    """A CUDA 12.5 build with a CUDA 11.8 driver: not loaded, a warning, info says why."""
    (tmp_path / paths.GPU_LIB_NAME).write_bytes(b"never loaded")
    build_info = {"tensorflow": tf.__version__, "cuda": "12.5", "cuda_archs": ["80", "90"]}
    with pytest.warns(RuntimeWarning, match="GPU kernels not used.*supports CUDA 11.8"):
        loaded, why = library.load_gpu_kernels(tmp_path, build_info, 11080)
    assert not loaded and "need a driver for CUDA 12.0 or newer" in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no driver at all: nothing to warn about
        loaded, why = library.load_gpu_kernels(tmp_path, build_info, None)
    assert not loaded and "no NVIDIA driver" in why
    cpu_build = {"tensorflow": tf.__version__, "cuda": None, "cuda_reason": "TF has no CUDA"}
    assert library.load_gpu_kernels(tmp_path, cpu_build, 12040) == (
        False,
        "not built: TF has no CUDA",
    )


def test_driver_version_query_without_a_driver():
    """This machine's answer is None (no libcuda) or a plausible CUDA version."""
    version = gpu.driver_cuda_version()
    assert version is None or version >= 9000
    assert gpu.format_cuda(12040) == "12.4" and gpu.format_cuda(11080) == "11.8"
