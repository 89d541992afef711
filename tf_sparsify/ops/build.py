"""Build the custom-op libraries against the installed TensorFlow.

``python -m tf_sparsify.ops.build`` compiles the kernel sources (a checkout's ``custom_ops/``,
an installed package's ``tf_sparsify/ops/src/``: :data:`~tf_sparsify.ops.paths.SOURCE_DIR`)
with the flags of the TensorFlow in this interpreter, into the folder chosen by
:mod:`tf_sparsify.ops.paths` (the package's ``lib/`` when writable, else a per-user cache):
``_tf_sparsify_ops.so`` (the ops and their CPU kernels), ``_tf_sparsify_ops_gpu.so`` (GPU
kernels over the CUDA core, static CUDA runtime) when CUDA is built, and ``build_info.json``
(TensorFlow and CUDA versions, architectures, and the fingerprint of the sources and this recipe,
:func:`~tf_sparsify.ops.paths.sources_fingerprint`), which the loader checks.

CUDA is built when TensorFlow is a CUDA build and an ``nvcc`` of the same CUDA major version is
found (``$CUDA_HOME/bin``, ``PATH``, ``/usr/local/cuda/bin``, ``/usr/local/cuda-*/bin``): a
library built with another major version would need a driver TensorFlow itself does not. A
CPU-only TensorFlow (``tensorflow-cpu``) gets CPU kernels only. ``TF_SPARSIFY_CUDA=0`` (or
``--cpu-only``) skips CUDA; ``TF_SPARSIFY_CUDA=1`` requires it (with any nvcc when TensorFlow has
no CUDA, which only checks that the GPU code compiles). ``CXX`` names the C++ compiler (default
``g++``); ``CXXFLAGS`` is added after the build's own flags, so it may override them (``-O0``:
a faster, unoptimized build). Unchanged objects are reused; a change of flags rebuilds. On
failure it prints why and exits with status 1.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tf_sparsify.ops.paths import (
    GPU_LIB_NAME,
    INFO_NAME,
    LIB_NAME,
    SOURCE_DIR,
    build_dir,
    sources_fingerprint,
)

#: the CPU sources as two translation units (one per core on two cores), each a file that
#: includes its sources: TensorFlow's headers, most of a file's compile time, are then parsed
#: twice instead of seven times (about 30 s of compiler time instead of 55). The sources keep
#: their helpers in distinct names, as one unit requires.
CPU_UNITS = (
    ("cc/kernels/topk_error_feedback_cpu.cc", "cc/ops/ops.cc", "cc/kernels/scatter_sum_cpu.cc"),
    (
        "cc/kernels/sparse_sgd_cpu.cc",
        "cc/kernels/qsgd_cpu.cc",
        "cc/kernels/index_code_cpu.cc",
        "cc/kernels/cast_feedback_cpu.cc",
    ),
)
CPU_SOURCES = tuple(source for unit in CPU_UNITS for source in unit)
GPU_HOST_SOURCES = ("cc/kernels/gpu_kernels.cc",)
CUDA_SOURCES = ("cuda/topk.cu", "cuda/qsgd.cu", "cuda/scatter_sum.cu")
CUDA_ENV = "TF_SPARSIFY_CUDA"
CXX_FLAGS = (
    "-O3",
    "-march=x86-64-v2",
    "-fPIC",
    "-ffp-contract=off",  # no FMA contraction: results must match the reference bit for bit
    "-fno-trapping-math",  # lets select-only loops vectorize; values are unchanged
    "-DNDEBUG",
)


class BuildError(RuntimeError):
    """A build step failed; the message says which and why."""


@dataclass(frozen=True)
class Job:
    """One compiler invocation producing ``output`` from ``source``, which reads ``inputs``."""

    source: Path
    output: Path
    command: tuple[str, ...]
    inputs: tuple[Path, ...]


@dataclass(frozen=True)
class Nvcc:
    """An nvcc and the CUDA version it compiles for ("13.0")."""

    path: Path
    version: str

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


def nvcc_candidates() -> list[Path]:
    """Executable nvccs, in order of preference, each once."""
    found = []
    if os.environ.get("CUDA_HOME"):
        found.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        found.append(Path(on_path))
    found.append(Path("/usr/local/cuda/bin/nvcc"))
    found += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*/bin/nvcc"), reverse=True)]
    unique: dict[Path, None] = {}
    for c in found:
        if c.is_file() and os.access(c, os.X_OK):
            unique.setdefault(c.resolve(), None)
    return list(unique)


def nvcc_version(nvcc: Path) -> str | None:
    """CUDA release of ``nvcc`` from ``nvcc --version`` ("release 12.5, V12.5.82")."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return f"{match[1]}.{match[2]}" if match else None


def find_nvcc() -> Path | None:
    """The first nvcc found, whatever its version (for compile checks of the CUDA core)."""
    candidates = nvcc_candidates()
    return candidates[0] if candidates else None


def choose_nvcc(
    tf_cuda: str | None, found: list[Nvcc], mode: str | None
) -> tuple[Nvcc | None, str]:
    """The nvcc to build the GPU kernels with, or None, and why.

    ``tf_cuda`` is TensorFlow's CUDA version (None for a CPU-only TensorFlow); ``mode`` is the
    value of ``$TF_SPARSIFY_CUDA`` ("0": never, "1": required, None: when it can run).
    """
    listed = ", ".join(f"{n.path} (CUDA {n.version})" for n in found) or "none"
    if mode == "0":
        return None, f"{CUDA_ENV}=0"
    if tf_cuda is None:
        if mode == "1" and found:
            return found[0], f"{CUDA_ENV}=1; TensorFlow has no CUDA, so this only checks the build"
        if mode == "1":
            raise BuildError(f"{CUDA_ENV}=1 but no nvcc found (set CUDA_HOME)")
        return None, "this TensorFlow is not a CUDA build, so GPU kernels could never run"
    major = int(tf_cuda.split(".")[0])
    for nvcc in found:
        if nvcc.major == major:
            return nvcc, f"TensorFlow is built with CUDA {tf_cuda}"
    reason = (
        f"TensorFlow is built with CUDA {tf_cuda} but no nvcc of CUDA {major}.x was found "
        f"(found: {listed}); install a CUDA {major} toolkit and set CUDA_HOME"
    )
    if mode == "1":
        raise BuildError(reason)
    return None, reason


def cuda_archs(nvcc: Nvcc) -> tuple[str, ...]:
    """SASS architectures (PTX of the last one is added): Volta only where CUDA still has it."""
    return ("70", "75", "80", "90") if nvcc.major <= 12 else ("75", "80", "90")


def cuda_library_dir(nvcc: Path) -> Path:
    """Directory holding ``libcudart_static.a`` next to ``nvcc``."""
    home = nvcc.parent.parent
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if (home / sub / "libcudart_static.a").is_file():
            return home / sub
    raise BuildError(f"nvcc found at {nvcc} but no libcudart_static.a under {home}")


def tensorflow_config() -> tuple[str, str | None, list[str], list[str]]:
    """(version, CUDA version or None, compile flags, link flags) of the installed TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError as err:
        raise BuildError(f"cannot import tensorflow: {err}") from err
    info = tf.sysconfig.get_build_info()
    cuda = info.get("cuda_version") if info.get("is_cuda_build") else None
    return (
        tf.__version__,
        str(cuda) if cuda else None,
        list(tf.sysconfig.get_compile_flags()),
        list(tf.sysconfig.get_link_flags()),
    )


def _stamp(job: Job) -> str:
    return hashlib.sha256("\0".join(job.command).encode()).hexdigest()


def _up_to_date(job: Job, newest_header: float) -> bool:
    stamp = job.output.with_suffix(".cmd")
    if not job.output.is_file() or not stamp.is_file() or stamp.read_text() != _stamp(job):
        return False
    built = job.output.stat().st_mtime
    return all(built >= p.stat().st_mtime for p in job.inputs) and built >= newest_header


def _run(command: list[str] | tuple[str, ...], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-6000:]
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n  {' '.join(command)}\n{tail}")


def _compile(job: Job) -> float:
    start = time.monotonic()
    _run(job.command, f"compiling {job.output.stem} ({', '.join(map(str, job.inputs))})")
    job.output.with_suffix(".cmd").write_text(_stamp(job))
    return time.monotonic() - start


def _host_job(cxx: str, src: str, objects: Path, tf_compile: list[str]) -> Job:
    return _cxx_job(cxx, SOURCE_DIR / src, objects / (Path(src).stem + ".o"), tf_compile)


def _unit_job(cxx: str, index: int, sources: tuple[str, ...], objects: Path, tf_compile) -> Job:
    """One translation unit of ``sources``: a file in ``objects`` that includes them."""
    unit = objects / f"cpu_unit{index}.cc"
    text = "".join(f'#include "{SOURCE_DIR / s}"\n' for s in sources)
    if not unit.is_file() or unit.read_text() != text:
        unit.write_text(text)
    job = _cxx_job(cxx, unit, unit.with_suffix(".o"), tf_compile)
    return Job(job.source, job.output, job.command, tuple(SOURCE_DIR / s for s in sources))


def _cxx_job(cxx: str, source: Path, out: Path, tf_compile: list[str]) -> Job:
    include = [f"-I{SOURCE_DIR / 'include'}", f"-I{SOURCE_DIR / 'cuda'}"]
    user = shlex.split(os.environ.get("CXXFLAGS", ""))
    command = (cxx, "-c", str(source), "-o", str(out), *CXX_FLAGS, *tf_compile, *user, *include)
    return Job(source, out, command, (source,))


def _cuda_job(nvcc: Nvcc, src: str, objects: Path) -> Job:
    out = objects / (Path(src).stem + "_cuda.o")
    archs = cuda_archs(nvcc)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}")
    command = (
        str(nvcc.path),
        "-c",
        str(SOURCE_DIR / src),
        "-o",
        str(out),
        "-std=c++17",
        "-O3",
        "--fmad=false",
        "-Xcompiler",
        "-fPIC",
        f"-I{SOURCE_DIR / 'include'}",
        *gencode,
    )
    return Job(SOURCE_DIR / src, out, command, (SOURCE_DIR / src,))


def _link(cxx: str, objects: list[Job], flags: list[str], target: Path) -> None:
    tmp = target.with_suffix(f".tmp{os.getpid()}.so")
    _run([cxx, "-shared", "-o", str(tmp), *(str(j.output) for j in objects), *flags], "linking")
    os.replace(tmp, target)


def build(cpu_only: bool = False, jobs: int | None = None, verbose: bool = False) -> Path:
    """Build the libraries; returns the folder holding them or raises BuildError."""
    if not SOURCE_DIR.is_dir():
        raise BuildError(f"kernel sources not found at {SOURCE_DIR} (a broken install?)")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise BuildError(f"C++ compiler {cxx!r} not found (set CXX)")
    tf_version, tf_cuda, tf_compile, tf_link = tensorflow_config()
    sources = sources_fingerprint()  # before compiling: a source edited meanwhile changes it
    mode = "0" if cpu_only else os.environ.get(CUDA_ENV)
    found = [Nvcc(p, v) for p in nvcc_candidates() if (v := nvcc_version(p))]
    nvcc, why = choose_nvcc(tf_cuda, found, mode)
    out_dir = build_dir(tf_version)
    objects = out_dir / "build"
    objects.mkdir(parents=True, exist_ok=True)
    cpu_jobs = [_unit_job(cxx, i, u, objects, tf_compile) for i, u in enumerate(CPU_UNITS)]
    gpu_jobs = []
    if nvcc:
        gpu_jobs = [_host_job(cxx, s, objects, tf_compile) for s in GPU_HOST_SOURCES]
        gpu_jobs += [_cuda_job(nvcc, s, objects) for s in CUDA_SOURCES]
    headers = [p.stat().st_mtime for ext in ("*.h", "*.cuh") for p in SOURCE_DIR.rglob(ext)]
    todo = [j for j in cpu_jobs + gpu_jobs if not _up_to_date(j, max(headers))]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for job, seconds in zip(todo, pool.map(_compile, todo), strict=True):
            if verbose:
                print(f"  {job.output.stem} ({len(job.inputs)} sources): {seconds:.1f} s")
    info_path = out_dir / INFO_NAME
    info_path.unlink(missing_ok=True)  # the loader refuses a library without matching info
    _link(cxx, cpu_jobs, tf_link, out_dir / LIB_NAME)
    gpu_lib = out_dir / GPU_LIB_NAME
    if nvcc:
        runtime = [
            f"-L{cuda_library_dir(nvcc.path)}",
            "-lcudart_static",
            "-ldl",
            "-lrt",
            "-lpthread",
        ]
        _link(cxx, gpu_jobs, [*tf_link, *runtime], gpu_lib)
    else:
        gpu_lib.unlink(missing_ok=True)
    info = {
        "tensorflow": tf_version,
        "cuda": nvcc.version if nvcc else None,
        "nvcc": str(nvcc.path) if nvcc else None,
        "cuda_archs": list(cuda_archs(nvcc)) if nvcc else [],
        "cuda_reason": why,
        "sources": sources,
    }
    info_path.write_text(json.dumps(info, indent=1) + "\n")
    what = f"CPU + CUDA {nvcc.version} ({why}; nvcc {nvcc.path})" if nvcc else f"CPU ({why})"
    print(
        f"built {out_dir / LIB_NAME} for TensorFlow {tf_version} [{what}]: {len(todo)} of "
        f"{len(cpu_jobs) + len(gpu_jobs)} objects compiled in {time.monotonic() - start:.0f} s"
    )
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-only", action="store_true", help="skip the CUDA kernels")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs")
    parser.add_argument("-v", "--verbose", action="store_true", help="print per-file times")
    args = parser.parse_args(argv)
    try:
        build(cpu_only=args.cpu_only, jobs=args.jobs, verbose=args.verbose)
    except BuildError as err:
        print(f"tf_sparsify.ops.build: build failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
