"""The TF-free CUDA core compiles (sm_90) and its C API loads and validates arguments.

Skipped only when nvcc is absent. Running the kernels needs a GPU: benchmarks/gpu/.
"""

from __future__ import annotations

import ctypes
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tf_sparsify.ops.build import find_nvcc
from tf_sparsify.ops.paths import SOURCE_DIR

NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def _nvcc(*args: str) -> None:
    proc = subprocess.run([str(NVCC), *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_cuda_core_compiles_and_loads(tmp_path: Path):
    flags = [
        "-std=c++17",
        "-O0",  # host code only (argument checks run there); the device code is optimized as built
        "--fmad=false",
        "-Xcompiler",
        "-fPIC",
        f"-I{SOURCE_DIR / 'include'}",
        "-gencode",
        "arch=compute_90,code=sm_90",
    ]
    sources = sorted((SOURCE_DIR / "cuda").glob("*.cu"))
    objects = [tmp_path / f"{s.stem}.o" for s in sources]
    with ThreadPoolExecutor(2) as pool:
        list(
            pool.map(
                lambda so: _nvcc(*flags, "-c", str(so[0]), "-o", str(so[1])),
                zip(sources, objects, strict=True),
            )
        )
    lib_path = tmp_path / "libtfs_cuda.so"
    _nvcc("-shared", "-cudart", "static", *map(str, objects), "-o", str(lib_path))

    lib = ctypes.CDLL(str(lib_path))
    lib.tfs_error_string.restype = ctypes.c_char_p
    size = ctypes.c_size_t()
    i64 = ctypes.c_int64
    assert lib.tfs_qsgd_workspace_bytes(i64(10**6), i64(512), ctypes.byref(size)) == 0
    assert size.value >= 2 * (10**6 // 512) * 8
    assert lib.tfs_qsgd_workspace_bytes(i64(10), i64(-1), ctypes.byref(size)) == -1
    for huge in (2**40, 2**62, 2**62 + 1, 2**63 - 1):  # clamped to n: no huge workspace
        assert lib.tfs_qsgd_workspace_bytes(i64(10), i64(huge), ctypes.byref(size)) == 0
        assert size.value <= 1024
    runtime, driver = ctypes.c_int(), ctypes.c_int()
    lib.tfs_cuda_versions(ctypes.byref(runtime), ctypes.byref(driver))
    assert runtime.value >= 12000
    null = ctypes.c_void_p()
    bad_k = lib.tfs_topk_error_feedback(
        2, null, null, null, i64(10), i64(11), null, null, 4, null, ctypes.c_size_t(0), null
    )
    assert bad_k == -1
    too_big = lib.tfs_topk_workspace_bytes(2, i64(2**31), i64(5), ctypes.byref(size))
    assert too_big == -1  # the op runs such tensors on its CPU kernel
    assert b"invalid argument" in lib.tfs_error_string(-1)
    bad_levels = lib.tfs_qsgd_quantize(
        2, null, i64(10), 0, i64(0), i64(0), null, null, null, ctypes.c_size_t(0), null
    )
    assert bad_levels == -1
    scatter = lib.tfs_scatter_sum
    scatter.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    scatter.argtypes += [i64, i64, ctypes.c_void_p, ctypes.c_void_p]
    for dtype, index_bytes, m, n in ((4, 4, 1, 1), (2, 2, 1, 1), (2, 4, -1, 1), (2, 8, 1, -1)):
        assert scatter(dtype, null, null, index_bytes, m, n, null, null) == -1
    assert scatter(0, null, null, 8, 5, 0, null, null) == 0  # n = 0: nothing to write
