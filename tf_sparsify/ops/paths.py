"""Where the compiled libraries live, for the build and the loader alike.

The build writes into the first of:

1. ``$TF_SPARSIFY_LIB_DIR`` when set (the loader then looks only there);
2. ``tf_sparsify/ops/lib/`` inside the installed package, when it is writable;
3. ``$XDG_CACHE_HOME/tf_sparsify/tf-<TF version>/`` (``~/.cache/...`` by default), for
   read-only installs such as a system-wide site-packages.

The loader tries (2) then (3) and takes the first whose ``build_info.json`` names the running
TensorFlow version.

The kernel sources live in the checkout's top-level ``custom_ops/`` (``cc/ops``, ``cc/kernels``,
``cuda``, ``include``); an installed package carries the same tree as ``tf_sparsify/ops/src/``
(``setup.py`` maps one onto the other), so the build finds them either way.
"""

from __future__ import annotations

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
