"""Per-kernel GPU time of the CUDA core's TopK and QSGD at n = 100M, by the PyTorch profiler.

Run after ``run_gpu_checks.sh`` has built the library (no TensorFlow needed)::

    python benchmarks/gpu/profile_kernels.py --lib $OUT/tfs_gpu/libtfs_cuda.so

Prints, per case, each kernel's mean microseconds per call of the op, largest first.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402


def kernel_times(torch, fn: Callable[[], object], calls: int = 10) -> list[tuple[str, float]]:
    """(kernel name, mean microseconds per call of fn), largest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if total:
            rows.append((event.key, total / calls))
    return sorted(rows, key=lambda row: -row[1])


def topk_case(core: gpu_check.CudaCore, n: int, density: float, kind: str) -> Callable:
    torch = core.torch
    k = max(int(n * density), 1)
    dtype = core.dtypes[kind]
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(n, device="cuda", generator=gen).to(dtype)
    r = torch.randn(n, device="cuda", generator=gen).to(dtype)
    code = gpu_check.CODES[kind]
    ws = core.workspace(lambda s: core.lib.tfs_topk_workspace_bytes(code, n, k, s), "ws")
    outputs = (
        torch.empty(k, dtype=dtype, device="cuda"),
        torch.empty(k, dtype=torch.int32, device="cuda"),
    )
    torch.cuda.synchronize()
    return lambda: core.topk_device(g, r, r, k, kind, 4, ws, outputs)


def qsgd_case(core: gpu_check.CudaCore, n: int, bucket: int) -> Callable:
    torch = core.torch
    x = torch.randn(n, device="cuda")
    q = torch.empty(n, dtype=torch.int8, device="cuda")
    norms = torch.empty(gpu_check.npref.num_buckets(n, bucket), device="cuda")
    ws, size = core.workspace(lambda s: core.lib.tfs_qsgd_workspace_bytes(n, bucket, s), "ws")
    torch.cuda.synchronize()
    args = (2, core.ptr(x), n, 127, bucket, 1, core.ptr(q), core.ptr(norms), core.ptr(ws), size)
    return lambda: core.check(core.lib.tfs_qsgd_quantize(*args, core.handle()), "quantize")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, help="path of libtfs_cuda.so")
    parser.add_argument("--n", type=int, default=100_000_000)
    args = parser.parse_args()
    core = gpu_check.CudaCore(args.lib)
    torch = core.torch
    cases = [
        (
            f"TopK {kind} k = {density:.1%}",
            lambda kind=kind, d=density: topk_case(core, args.n, d, kind),
        )
        for kind in ("float16", "float32")
        for density in (0.01, 0.001)
    ] + [
        (f"QSGD quantize float32 bucket {b}", lambda b=b: qsgd_case(core, args.n, b))
        for b in (512, 0)
    ]
    for title, make in cases:
        fn = make()
        with torch.cuda.stream(core.stream):
            rows = kernel_times(torch, fn)
        core._guarded.clear()
        print(f"\n{title}, n = {args.n:,}: {sum(us for _, us in rows):.0f} us of kernels per call")
        for name, us in rows[:12]:
            print(f"  {us:9.1f} us  {name[:110]}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
