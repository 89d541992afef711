"""What :func:`tf_sparsify.ops.info` reports: which compiled kernels are loaded, for which
devices, and the CUDA versions involved (``python -m tf_sparsify info`` prints it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import tensorflow as tf

from tf_sparsify.ops import dispatch, library
from tf_sparsify.ops.gpu import format_cuda


@dataclass(frozen=True)
class OpsInfo:
    """What :func:`info` reports; ``str()`` gives a readable summary."""

    compiled: bool
    library: str
    reason: str | None
    kernels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    gpus: tuple[str, ...] = ()
    tensorflow: str = tf.__version__
    cuda_built: str | None = None
    cuda_archs: tuple[str, ...] = ()
    cuda_driver: str | None = None
    gpu_kernels: bool = False
    gpu_reason: str | None = None
    origin: str | None = None

    def __str__(self) -> str:
        if not self.compiled:
            return (
                f"tf_sparsify ops: compiled kernels NOT loaded ({self.reason});\n"
                "  every op runs the pure-TF reference (tf_sparsify.ops.pure_tf)"
            )
        lines = [
            f"tf_sparsify ops: compiled kernels loaded from {self.library}",
            f"  origin: {self.origin}",
        ]
        lines += [f"  {op}: {', '.join(devs) or 'no kernels'}" for op, devs in self.kernels.items()]
        driver = f"CUDA {self.cuda_driver}" if self.cuda_driver else "none found"
        if self.cuda_built:
            archs = ", ".join(f"sm_{a}" for a in self.cuda_archs)
            lines.append(f"  CUDA: built with CUDA {self.cuda_built} ({archs}); driver: {driver}")
            state = "loaded" if self.gpu_kernels else f"NOT loaded ({self.gpu_reason})"
            lines.append(f"  GPU kernels: {state}")
        else:
            lines.append(f"  CUDA: GPU kernels {self.gpu_reason}; driver: {driver}")
        lines.append(
            f"  GPUs visible to TensorFlow {self.tensorflow}: {', '.join(self.gpus) or 'none'}"
        )
        return "\n".join(lines)


def _registered_devices(op: str) -> tuple[str, ...]:
    from tensorflow.python.framework import kernels

    found = {k.device_type for k in kernels.get_registered_kernels_for_op(op).kernel}
    return tuple(sorted(found))


def info() -> OpsInfo:
    """Which compiled kernels are loaded, for which devices, and the CUDA versions involved."""
    lib = dispatch.loaded_library()
    gpus = tuple(d.name for d in tf.config.list_physical_devices("GPU"))
    path = str(lib.directory) if lib.directory else "(none)"
    if lib.module is None:
        return OpsInfo(False, path, lib.reason, gpus=gpus)
    kernels = {op: _registered_devices(op) for op in library.OP_NAMES}
    build = lib.build or {}
    return OpsInfo(
        True,
        path,
        None,
        kernels,
        gpus,
        cuda_built=build.get("cuda"),
        cuda_archs=tuple(build.get("cuda_archs", ())),
        cuda_driver=format_cuda(lib.driver) if lib.driver else None,
        gpu_kernels=lib.gpu_loaded,
        gpu_reason=lib.gpu_reason,
        origin=f"{library.origin(build)} for TensorFlow {build.get('tensorflow')}",
    )
