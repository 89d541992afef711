"""Where the compiled libraries live, for the build and the loader alike.

The build writes into the first of:

1. ``$TF_SPARSIFY_LIB_DIR`` when set (the loader then looks only there);
2. ``tf_sparsify/ops/lib/`` inside the installed package, when it is writable;
3. ``$XDG_CACHE_HOME/tf_sparsify/tf-<TF version>/`` (``~/.cache/...`` by default), for
   read-only installs such as a system-wide site-packages.

The loader tries (2) then (3) and takes the first whose ``build_info.json`` names the running
TensorFlow's minor version.

A platform wheel (``make wheel``) carries a library in (2), built for one TensorFlow minor
version, with ``"wheel"`` in its build info; ``python -m tf_sparsify.ops.build`` replaces it
when the package folder is writable.

The kernel sources live in the checkout's top-level ``custom_ops/`` (``cc/ops``, ``cc/kernels``,
``cuda``, ``include``); an installed package carries the same tree as ``tf_sparsify/ops/src/``
(``setup.py`` maps one onto the other), so the build finds them either way.
:func:`sources_fingerprint` names what a build compiled, so a build can be proven current.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LIB_NAME = "_tf_sparsify_ops.so"
GPU_LIB_NAME = "_tf_sparsify_ops_gpu.so"
INFO_NAME = "build_info.json"
LIB_DIR_ENV = "TF_SPARSIFY_LIB_DIR"
PACKAGE_LIB_DIR = Path(__file__).resolve().parent / "lib"
_ROOT = Path(__file__).resolve().parents[2]
#: the kernel sources: a checkout's ``custom_ops/`` (next to its ``setup.cfg``), else the
#: installed package's copy
SOURCE_DIR = (
    _ROOT / "custom_ops"
    if (_ROOT / "setup.cfg").is_file() and (_ROOT / "custom_ops").is_dir()
    else Path(__file__).resolve().parent / "src"
)

SOURCE_SUFFIXES = (".cc", ".h", ".cu", ".cuh")
#: the build recipe (source list, compiler flags), part of :func:`sources_fingerprint`
BUILD_SCRIPT = Path(__file__).resolve().parent / "build.py"


def sources_fingerprint() -> str:
    """SHA-256 of the kernel sources (paths and contents) and the build recipe: equal
    fingerprints mean a library was built from the same code with the same flags."""
    sources = sorted(p for p in SOURCE_DIR.rglob("*") if p.suffix in SOURCE_SUFFIXES)
    named = [(p.relative_to(SOURCE_DIR).as_posix(), p) for p in sources]
    digest = hashlib.sha256()
    for name, path in [*named, ("build.py", BUILD_SCRIPT)]:
        content = path.read_bytes()
        digest.update(f"{name}\0{len(content)}\0".encode() + content)
    return digest.hexdigest()


def cache_dir(tf_version: str) -> Path:
    """The per-user fallback, one folder per TensorFlow version."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tf_sparsify" / f"tf-{tf_version}"


def writable(directory: Path) -> bool:
    """Whether ``directory`` exists writable, or could be created under a writable parent."""
    for d in (directory, *directory.parents):
        if d.exists():
            return d.is_dir() and os.access(d, os.W_OK | os.X_OK)
    return False


def build_dir(tf_version: str) -> Path:
    """Where a build for ``tf_version`` goes (see the module docstring)."""
    if os.environ.get(LIB_DIR_ENV):
        return Path(os.environ[LIB_DIR_ENV])
    if writable(PACKAGE_LIB_DIR):
        return PACKAGE_LIB_DIR
    return cache_dir(tf_version)


def search_dirs(tf_version: str) -> list[Path]:
    """Folders the loader tries, in order."""
    if os.environ.get(LIB_DIR_ENV):
        return [Path(os.environ[LIB_DIR_ENV])]
    return [PACKAGE_LIB_DIR, cache_dir(tf_version)]
