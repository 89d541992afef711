"""Can this machine run the GPU kernels? The NVIDIA driver's CUDA version and the GPUs' compute
capabilities against what the library was built with (no TensorFlow needed here).

A library built with CUDA X.Y links the CUDA X runtime statically; it runs on any driver that
supports CUDA X.0 or newer (CUDA's minor-version compatibility) and on GPUs whose compute
capability has SASS in it (same major, minor at least the built one) or, above the newest
built architecture, through its PTX.
"""

from __future__ import annotations

import ctypes


def driver_cuda_version() -> int | None:
    """The CUDA version the installed driver supports (e.g. 12040 for 12.4), None without one."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return version.value


def format_cuda(version: int) -> str:
    """12040 -> '12.4'."""
    return f"{version // 1000}.{version % 1000 // 10}"


def runs_on(capability: tuple[int, int], archs: list[str]) -> bool:
    """Whether code built for ``archs`` (e.g. ['80', '90'], PTX of the last) runs on a GPU of
    ``capability`` (major, minor)."""
    built = sorted((int(a) // 10, int(a) % 10) for a in archs)
    sass = any(major == capability[0] and minor <= capability[1] for major, minor in built)
    return sass or (bool(built) and capability >= built[-1])


def gpu_kernels_problem(
    built_cuda: str, archs: list[str], driver: int | None, capabilities: list[tuple[int, int]]
) -> str | None:
    """Why GPU kernels built with CUDA ``built_cuda`` for ``archs`` cannot run here, or None."""
    if driver is None:
        return "no NVIDIA driver found (libcuda.so.1)"
    major = int(built_cuda.split(".")[0])
    if driver // 1000 < major:
        return (
            f"they were built with CUDA {built_cuda} and need a driver for CUDA {major}.0 or "
            f"newer, but the NVIDIA driver supports CUDA {format_cuda(driver)}"
        )
    for cc in capabilities:
        if not runs_on(cc, archs):
            built = ", ".join(f"sm_{a}" for a in archs)
            return (
                f"a GPU of compute capability {cc[0]}.{cc[1]} is not covered by the built "
                f"architectures ({built}, PTX of sm_{archs[-1]})"
            )
    return None
