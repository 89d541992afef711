"""Build the custom-op library against the installed TensorFlow.

``python -m tf_sparsify.ops.build`` compiles ``tf_sparsify/ops/src/`` into
``tf_sparsify/ops/lib/_tf_sparsify_ops.so`` with the flags of the TensorFlow in this interpreter.
When ``nvcc`` is found (``$CUDA_HOME/bin``, ``/usr/local/cuda/bin`` or ``PATH``) the CUDA core is
built for sm_80 and sm_90 and linked with the static CUDA runtime; otherwise, or with
``--cpu-only`` / ``TF_SPARSIFY_CUDA=0``, only the CPU kernels are built. Unchanged objects are
reused. On failure it prints why and exits with status 1.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
LIB_DIR = PACKAGE_DIR / "lib"
LIB_PATH = LIB_DIR / "_tf_sparsify_ops.so"
SOURCE_DIR = PACKAGE_DIR / "src"

CPU_SOURCES = (
    "cc/ops/ops.cc",
    "cc/kernels/topk_error_feedback_cpu.cc",
    "cc/kernels/qsgd_cpu.cc",
)
GPU_HOST_SOURCES = ("cc/kernels/gpu_kernels.cc",)
CUDA_SOURCES = ("cuda/topk.cu", "cuda/qsgd.cu")
CUDA_ARCHS = ("80", "90")
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
    """One compiler invocation producing ``output``."""

    source: Path
    output: Path
    command: tuple[str, ...]


def find_nvcc() -> Path | None:
    """nvcc from ``$CUDA_HOME``, ``/usr/local/cuda`` or ``PATH``, or None."""
    candidates = []
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    on_path = shutil.which("nvcc")
    if on_path:
        candidates.append(Path(on_path))
    return next((c.resolve() for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def cuda_library_dir(nvcc: Path) -> Path:
    """Directory holding ``libcudart_static.a`` next to ``nvcc``."""
    home = nvcc.parent.parent
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if (home / sub / "libcudart_static.a").is_file():
            return home / sub
    raise BuildError(f"nvcc found at {nvcc} but no libcudart_static.a under {home}")


def tensorflow_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) of the installed TensorFlow."""
    try:
        import tensorflow as tf
    except ImportError as err:
        raise BuildError(f"cannot import tensorflow: {err}") from err
    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def _stamp(job: Job) -> str:
    return hashlib.sha256("\0".join(job.command).encode()).hexdigest()


def _headers() -> list[Path]:
    return [p for p in SOURCE_DIR.rglob("*.h")]


def _up_to_date(job: Job, newest_header: float) -> bool:
    stamp = job.output.with_suffix(".cmd")
    if not job.output.is_file() or not stamp.is_file() or stamp.read_text() != _stamp(job):
        return False
    built = job.output.stat().st_mtime
    return built >= job.source.stat().st_mtime and built >= newest_header


def _run(command: list[str] | tuple[str, ...], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-6000:]
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n  {' '.join(command)}\n{tail}")


def _compile(job: Job) -> float:
    start = time.monotonic()
    _run(job.command, f"compiling {job.source.relative_to(SOURCE_DIR)}")
    job.output.with_suffix(".cmd").write_text(_stamp(job))
    return time.monotonic() - start


def plan(cxx: str, nvcc: Path | None, build_dir: Path) -> tuple[list[Job], list[str]]:
    """Compile jobs and the extra link flags."""
    tf_compile, tf_link = tensorflow_flags()
    include = [f"-I{SOURCE_DIR / 'include'}", f"-I{SOURCE_DIR / 'cuda'}"]
    host_sources = CPU_SOURCES + (GPU_HOST_SOURCES if nvcc else ())
    jobs = [
        Job(
            SOURCE_DIR / src,
            build_dir / (Path(src).stem + ".o"),
            (cxx, "-c", str(SOURCE_DIR / src), "-o", str(build_dir / (Path(src).stem + ".o")))
            + CXX_FLAGS
            + tuple(tf_compile + include),
        )
        for src in host_sources
    ]
    link = list(tf_link)
    if nvcc:
        gencode = []
        for arch in CUDA_ARCHS:
            gencode += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        gencode += ["-gencode", f"arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}"]
        for src in CUDA_SOURCES:
            out = build_dir / (Path(src).stem + "_cuda.o")
            command = (
                str(nvcc),
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
            jobs.append(Job(SOURCE_DIR / src, out, command))
        link += [f"-L{cuda_library_dir(nvcc)}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
    return jobs, link


def build(cpu_only: bool = False, jobs: int | None = None, verbose: bool = False) -> Path:
    """Build the library; returns its path or raises BuildError."""
    if not SOURCE_DIR.is_dir():
        raise BuildError(f"sources not found at {SOURCE_DIR} (build from a source checkout)")
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise BuildError(f"C++ compiler {cxx!r} not found (set CXX)")
    nvcc = None if cpu_only or os.environ.get("TF_SPARSIFY_CUDA") == "0" else find_nvcc()
    build_dir = LIB_DIR / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    compile_jobs, link_flags = plan(cxx, nvcc, build_dir)
    newest_header = max(p.stat().st_mtime for p in _headers())
    todo = [j for j in compile_jobs if not _up_to_date(j, newest_header)]
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        for job, seconds in zip(todo, pool.map(_compile, todo), strict=True):
            if verbose:
                print(f"  {job.source.relative_to(SOURCE_DIR)}: {seconds:.1f} s")
    tmp = LIB_PATH.with_suffix(f".tmp{os.getpid()}.so")
    objects = [str(j.output) for j in compile_jobs]
    _run([cxx, "-shared", "-o", str(tmp), *objects, *link_flags], "linking")
    os.replace(tmp, LIB_PATH)
    where = "CPU + CUDA (sm_" + ", sm_".join(CUDA_ARCHS) + f"; nvcc {nvcc})" if nvcc else "CPU"
    reason = "" if nvcc or cpu_only else " (nvcc not found; set CUDA_HOME for the CUDA kernels)"
    print(
        f"built {LIB_PATH} [{where}]{reason}: {len(todo)} of {len(compile_jobs)} objects "
        f"compiled in {time.monotonic() - start:.0f} s"
    )
    return LIB_PATH


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
