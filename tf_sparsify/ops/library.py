"""Loads the compiled libraries: the ops with their CPU kernels, then the GPU kernels when this
machine can run them.

A library is used only when its ``build_info.json`` names the running TensorFlow's minor version
(an op library must be built against the TensorFlow it is loaded into; TensorFlow keeps the
custom-op ABI within a minor release, which is what the ``>=2.21,<2.22`` pins of binary wheels
such as ``make wheel``'s and tensorflow-text's rely on); otherwise the reason says how to build
one from source. The GPU kernels live in a library of their own so that they can be left
unregistered: when the NVIDIA driver is too old for the CUDA version they were built with, or a
GPU's architecture is not in them, a warning says so once and TensorFlow places the ops on the
CPU kernels instead of failing every step.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import tensorflow as tf

from tf_sparsify.ops import gpu
from tf_sparsify.ops.paths import GPU_LIB_NAME, INFO_NAME, LIB_NAME, search_dirs

OP_NAMES = (
    "TopKErrorFeedback",
    "QSGDQuantize",
    "QSGDDequantize",
    "ScatterSum",
    "IndexCodeEncode",
    "IndexCodeDecode",
    "SparseSgdApply",
    "SaturatingCastFeedback",
    "WireToFloat",
    "WireSum",
    "TopKErrorFeedbackPacked",
    "IndexCodeEncodePacked",
    "IndexCodeDecodePacked",
    "PackedDecompressSum",
    "SparseSgdApplyPacked",
)
#: every op but ScatterSum, whose gradient :func:`load` registers
NOT_DIFFERENTIABLE = tuple(name for name in OP_NAMES if name != "ScatterSum")


@dataclass(frozen=True)
class Library:
    """What loading found: the op module (None when not loaded) and why not."""

    module: ModuleType | None
    reason: str | None
    directory: Path | None = None
    build: dict[str, Any] | None = None
    gpu_loaded: bool = False
    gpu_reason: str | None = None
    driver: int | None = None


def read_build_info(directory: Path) -> dict[str, Any] | None:
    """``build_info.json`` of ``directory``, None when missing or unreadable."""
    try:
        return json.loads((directory / INFO_NAME).read_text())
    except (OSError, ValueError):
        return None


def same_minor(built_for: str | None, running: str) -> bool:
    """Whether a library built for TensorFlow ``built_for`` fits TensorFlow ``running``."""
    return built_for is not None and built_for.split(".")[:2] == running.split(".")[:2]


def origin(build: dict[str, Any]) -> str:
    """Where a library comes from: a tf_sparsify wheel, or a build from source."""
    wheel = build.get("wheel")
    return f"packaged in the tf_sparsify {wheel} wheel" if wheel else "built from source"


def build_hint(tf_version: str) -> str:
    """How to get kernels for TensorFlow ``tf_version``."""
    minor = ".".join(tf_version.split(".")[:2])
    return (
        "run `python -m tf_sparsify.ops.build` to build them from source (needs a C++ compiler "
        f"and TensorFlow's headers), or install a tf_sparsify wheel built for TensorFlow {minor}"
    )


def find(tf_version: str) -> tuple[Path | None, dict[str, Any] | None, str]:
    """The first folder holding a library built for ``tf_version``'s minor version, its build
    info, and (when none) why not and how to build one."""
    problems = []
    for directory in search_dirs(tf_version):
        if not (directory / LIB_NAME).is_file():
            continue
        info = read_build_info(directory)
        built_for = info.get("tensorflow") if info else None
        if same_minor(built_for, tf_version):
            return directory, info, ""
        problems.append(
            f"the compiled kernels in {directory} ({origin(info or {})}) were built for "
            f"TensorFlow {built_for or '(unknown)'}, this is {tf_version}"
        )
    where = " or ".join(str(d) for d in search_dirs(tf_version))
    reason = "; ".join(problems) or f"no compiled kernels ({LIB_NAME}) in {where}"
    return None, None, f"{reason}: {build_hint(tf_version)}"


def _gpu_capabilities() -> list[tuple[int, int]]:
    found = []
    for device in tf.config.list_physical_devices("GPU"):
        cc = tf.config.experimental.get_device_details(device).get("compute_capability")
        if cc:
            found.append((int(cc[0]), int(cc[1])))
    return found


def load_gpu_kernels(
    directory: Path, build: dict[str, Any], driver: int | None
) -> tuple[bool, str | None]:
    """Registers the GPU kernels when they can run with ``driver`` (the driver's CUDA version,
    None without a driver): ``(loaded, why not)``. Warns when a driver is present but cannot run
    them (once: the library is loaded once per process)."""
    if not build.get("cuda"):
        return False, f"not built: {build.get('cuda_reason') or 'no CUDA build'}"
    path = directory / GPU_LIB_NAME
    if not path.is_file():
        return False, f"{path} not found"
    capabilities = _gpu_capabilities() if driver is not None else []
    problem = gpu.gpu_kernels_problem(build["cuda"], build["cuda_archs"], driver, capabilities)
    if problem is None:
        try:
            tf.load_op_library(str(path))
        except (tf.errors.OpError, OSError) as err:
            problem = f"cannot load {path}: {err}"
    if problem is None:
        return True, None
    if driver is not None:
        warnings.warn(
            f"tf_sparsify: GPU kernels not used ({problem}); the ops run their CPU kernels",
            RuntimeWarning,
            stacklevel=2,
        )
    return False, problem


def _scatter_sum_gradient(op: tf.Operation, grad: tf.Tensor) -> tuple[tf.Tensor | None, ...]:
    """ScatterSum is linear in ``values``: each value gets the gradient at its index."""
    return tf.gather(grad, op.inputs[1]), None, None


def load() -> Library:
    """Loads the libraries built for the running TensorFlow (see the module docstring)."""
    directory, build, reason = find(tf.__version__)
    if directory is None or build is None:
        return Library(None, reason)
    path = directory / LIB_NAME
    try:
        module = tf.load_op_library(str(path))
    except (tf.errors.OpError, OSError) as err:
        return Library(None, f"cannot load {path}: {err}", directory, build)
    missing = [name for name in OP_NAMES if not hasattr(module, name)]
    if missing:  # built from older sources
        why = f"{path} lacks {', '.join(missing)}: rebuild with python -m tf_sparsify.ops.build"
        return Library(None, why, directory, build)
    for name in NOT_DIFFERENTIABLE:
        tf.no_gradient(name)
    tf.RegisterGradient("ScatterSum")(_scatter_sum_gradient)
    driver = gpu.driver_cuda_version()
    loaded, why = load_gpu_kernels(directory, build, driver)
    return Library(module, None, directory, build, loaded, why, driver)
