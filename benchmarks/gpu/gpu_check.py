"""Check the TF-free CUDA core against the NumPy model, then time it (no TensorFlow needed).

Run through ``run_gpu_checks.sh``, which builds ``libtfs_cuda.so`` first. Needs NumPy and
PyTorch with CUDA (for device memory, the stream and the torch.topk baseline). Exit status 1
when any correctness case fails; performance goals are reported, not enforced.

``--tf-cpu`` runs the same correctness cases against the compiled TensorFlow CPU kernels
instead (no GPU), to check this harness itself.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "numpy_reference", ROOT / "tf_sparsify" / "ops" / "numpy_reference.py"
)
npref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(npref)

CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}
UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}
NAN_ABOVE = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000}


class CudaCore:
    """ctypes bindings of libtfs_cuda.so on PyTorch device memory and stream."""

    def __init__(self, path: str) -> None:
        import torch

        self.torch = torch
        self.lib = lib = ctypes.CDLL(path)
        c_int, c_i64, c_ptr, c_size = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
        size_out = ctypes.POINTER(c_size)
        lib.tfs_topk_workspace_bytes.argtypes = [c_int, c_i64, c_i64, size_out]
        lib.tfs_topk_error_feedback.argtypes = [
            c_int,
            c_ptr,
            c_ptr,
            c_ptr,
            c_i64,
            c_i64,
            c_ptr,
            c_ptr,
            c_int,
            c_ptr,
            c_size,
            c_ptr,
        ]
        lib.tfs_qsgd_workspace_bytes.argtypes = [c_i64, c_i64, size_out]
        lib.tfs_qsgd_quantize.argtypes = [
            c_int,
            c_ptr,
            c_i64,
            c_int,
            c_i64,
            c_i64,
            c_ptr,
            c_ptr,
            c_ptr,
            c_size,
            c_ptr,
        ]
        lib.tfs_qsgd_dequantize.argtypes = [c_int, c_ptr, c_ptr, c_i64, c_int, c_i64, c_ptr, c_ptr]
        for name in (
            "tfs_topk_workspace_bytes",
            "tfs_topk_error_feedback",
            "tfs_qsgd_workspace_bytes",
            "tfs_qsgd_quantize",
            "tfs_qsgd_dequantize",
        ):
            getattr(lib, name).restype = c_int
        lib.tfs_error_string.argtypes = [c_int]
        lib.tfs_error_string.restype = ctypes.c_char_p
        self.dtypes = {
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "float32": torch.float32,
            "float64": torch.float64,
        }
        self.ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: {self.lib.tfs_error_string(code).decode()}")

    @staticmethod
    def ptr(t) -> ctypes.c_void_p:
        return ctypes.c_void_p(t.data_ptr())

    def stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.torch.cuda.current_stream().cuda_stream)

    def to_device(self, bits: np.ndarray, kind: str):
        signed = np.ascontiguousarray(bits).view(SIGNED[bits.itemsize])
        return self.torch.from_numpy(signed.copy()).cuda().view(self.dtypes[kind])

    def to_host(self, t) -> np.ndarray:
        size = t.element_size()
        return t.view(self.ints[size]).cpu().numpy().view(UNSIGNED[size])

    def workspace(self, query: Callable[[ctypes.c_size_t], int], what: str):
        size = ctypes.c_size_t()
        self.check(query(ctypes.byref(size)), what)
        return self.torch.empty(max(size.value, 1), dtype=self.torch.uint8, device="cuda"), size

    def topk_device(self, g, r, out, k: int, kind: str, index_bytes: int, ws=None):
        """Runs on device tensors; returns (values, indices) tensors."""
        torch, n = self.torch, g.numel()
        values = torch.empty(k, dtype=g.dtype, device="cuda")
        indices = torch.empty(
            k, dtype=torch.int32 if index_bytes == 4 else torch.int64, device="cuda"
        )
        if ws is None:
            ws = self.workspace(
                lambda s: self.lib.tfs_topk_workspace_bytes(CODES[kind], n, k, s), "workspace"
            )
        code = self.lib.tfs_topk_error_feedback(
            CODES[kind],
            self.ptr(g),
            self.ptr(r),
            self.ptr(out),
            n,
            k,
            self.ptr(values),
            self.ptr(indices),
            index_bytes,
            self.ptr(ws[0]),
            ws[1],
            self.stream(),
        )
        self.check(code, "tfs_topk_error_feedback")
        return values, indices

    def topk(self, g_bits, r_bits, k, kind, index_bytes=4, in_place=False):
        g, r = self.to_device(g_bits, kind), self.to_device(r_bits, kind)
        out = r if in_place else self.torch.empty_like(r)
        values, indices = self.topk_device(g, r, out, k, kind, index_bytes)
        self.torch.cuda.synchronize()
        return self.to_host(values), indices.cpu().numpy().astype(np.int64), self.to_host(out)

    def quantize(self, bits, kind, levels, bucket_size, seed):
        torch, n = self.torch, bits.size
        x = self.to_device(bits, kind)
        q = torch.empty(n, dtype=torch.int8 if levels <= 127 else torch.int16, device="cuda")
        norms = torch.empty(npref.num_buckets(n, bucket_size), dtype=torch.float32, device="cuda")
        ws, size = self.workspace(
            lambda s: self.lib.tfs_qsgd_workspace_bytes(n, bucket_size, s), "workspace"
        )
        code = self.lib.tfs_qsgd_quantize(
            CODES[kind],
            self.ptr(x),
            n,
            levels,
            bucket_size,
            seed,
            self.ptr(q),
            self.ptr(norms),
            self.ptr(ws),
            size,
            self.stream(),
        )
        self.check(code, "tfs_qsgd_quantize")
        torch.cuda.synchronize()
        return q.cpu().numpy(), norms.cpu().numpy()

    def dequantize(self, q, norms, levels, bucket_size, kind):
        torch = self.torch
        qd = torch.from_numpy(q.copy()).cuda()
        nd = torch.from_numpy(norms.copy()).cuda()
        out = torch.empty(q.size, dtype=self.dtypes[kind], device="cuda")
        code = self.lib.tfs_qsgd_dequantize(
            CODES[kind],
            self.ptr(qd),
            self.ptr(nd),
            q.size,
            levels,
            bucket_size,
            self.ptr(out),
            self.stream(),
        )
        self.check(code, "tfs_qsgd_dequantize")
        torch.cuda.synchronize()
        return self.to_host(out)


class TfCpuCore:
    """The same interface over the compiled TensorFlow CPU kernels (checks this harness)."""

    def __init__(self) -> None:
        import tensorflow as tf

        sys.path.insert(0, str(ROOT))
        import tf_sparsify.ops as ops

        assert ops.is_compiled(), ops.info().reason
        self.tf, self.ops = tf, ops
        self.dtypes = {
            "float16": tf.float16,
            "bfloat16": tf.bfloat16,
            "float32": tf.float32,
            "float64": tf.float64,
        }
        self.uints = {2: tf.uint16, 4: tf.uint32, 8: tf.uint64}

    def to_tensor(self, bits, kind):
        return self.tf.bitcast(self.tf.constant(bits), self.dtypes[kind])

    def to_host(self, t):
        return self.tf.bitcast(t, self.uints[t.dtype.size]).numpy()

    def topk(self, g_bits, r_bits, k, kind, index_bytes=4, in_place=False):
        g, r = self.to_tensor(g_bits, kind), self.to_tensor(r_bits, kind)
        values, indices, out = self.ops.topk_error_feedback(g, r, k)
        return self.to_host(values), indices.numpy().astype(np.int64), self.to_host(out)

    def quantize(self, bits, kind, levels, bucket_size, seed):
        q, norms = self.ops.qsgd_quantize(self.to_tensor(bits, kind), levels, bucket_size, seed)
        return q.numpy(), norms.numpy()

    def dequantize(self, q, norms, levels, bucket_size, kind):
        out = self.ops.qsgd_dequantize(q, norms, levels, bucket_size, [q.size], self.dtypes[kind])
        return self.to_host(out)


def is_nan(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float64":
        return np.isnan(bits.view(np.float64))
    return (bits & np.asarray(0x7FFFFFFF if kind == "float32" else 0x7FFF, bits.dtype)) > (
        np.asarray(NAN_ABOVE[kind], bits.dtype)
    )


def same_bits(a: np.ndarray, b: np.ndarray, kind: str) -> bool:
    """Bit-identical, except that any NaN matches any NaN (payloads differ across devices)."""
    if a.shape != b.shape:
        return False
    both_nan = is_nan(a, kind) & is_nan(b, kind)
    return bool(np.all((a == b) | both_nan))


def from_f64(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float64":
        return x.astype(np.float64).view(np.uint64)
    if kind == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint16)
    with np.errstate(over="ignore"):
        return npref.from_f32(x.astype(np.float32), kind)


def topk_cases(rng: np.random.Generator, kind: str):
    """(name, grad, residual, k) adversarial and random cases."""
    tiny = {
        "float16": 2.0**-14,
        "bfloat16": 2.0**-126,
        "float32": 2.0**-126,
        "float64": 2.0**-1022,
    }[kind]
    big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}[kind]
    for n in (1, 7, 1023, 100003, (1 << 20) + 3):
        g, r = from_f64(rng.standard_normal(n), kind), from_f64(rng.standard_normal(n), kind)
        for k in sorted({0, 1, max(n // 1000, 1), max(n // 100, 1), n // 8 + 1, n}):
            yield f"random n={n} k={k}", g, r, k
    n = 70001
    zeros = from_f64(np.zeros(n), kind)
    for value in (0.0, -0.0, 1.5):
        for k in (1, 5, n // 10, n - 1, n):
            yield f"all {value} k={k}", from_f64(np.full(n, value), kind), zeros, k
    few = from_f64(rng.integers(-3, 4, n).astype(np.float64), kind)
    for k in (1, 100, n // 16, n // 3):
        yield f"few values k={k}", few, zeros, k
    signed_zeros = from_f64(np.where(rng.random(n) < 0.5, -0.0, 0.0), kind)
    yield "signed zeros", signed_zeros, signed_zeros, 10
    x = rng.standard_normal(n)
    with np.errstate(over="ignore"):
        x[::7] *= big
    x[3::11] = tiny / 8
    x[5::13] = -tiny / 2
    x[1::17] = np.inf
    x[2::19] = -np.inf
    x[4::23] = np.nan
    small = from_f64(rng.standard_normal(n) * 1e-3, kind)
    for k in (1, int(np.isnan(x).sum()), 5000):
        yield f"extremes k={k}", from_f64(x, kind), small, k


def qsgd_cases(rng: np.random.Generator, kind: str):
    """(name, bits, levels, bucket_size, seed)."""
    for n, levels, bucket in (
        (0, 4, 0),
        (1, 1, 0),
        (7, 127, 3),
        (1023, 128, 0),
        (1023, 32767, 512),
        (100003, 4, 512),
        (100003, 15, 0),
        (5000, 3, 7),
        (5000, 2, 9000),
        (1 << 20, 127, 4096),
        ((1 << 20) + 5, 8, 0),
    ):
        for seed in (0, -7, 2**40 + 12345):
            x = from_f64(rng.standard_normal(n) * 3, kind)
            yield f"n={n} levels={levels} bucket={bucket} seed={seed}", x, levels, bucket, seed
    x = rng.standard_normal(3000)
    x[::10] = 0.0
    x[1::10] = -0.0
    x[4::503] = np.nan
    x[5::607] = -np.inf
    for bucket in (0, 64, 100):
        yield f"special bucket={bucket}", from_f64(x, kind), 8, bucket, 99


def run_correctness(core, flush: bool, big_n: int) -> list[str]:
    """Every case against the NumPy model; returns the failures."""
    failures: list[str] = []
    rng = np.random.default_rng(2024)
    for kind in npref.KINDS:
        count = 0
        for name, g, r, k in topk_cases(rng, kind):
            for index_bytes, in_place in ((4, False), (8, True)):
                ev, ei, er = npref.topk_error_feedback(g, r, k, kind, flush)
                v, i, out = core.topk(g, r, k, kind, index_bytes, in_place)
                ok = np.array_equal(i, ei) and same_bits(v, ev, kind) and same_bits(out, er, kind)
                count += 1
                if not ok:
                    failures.append(f"topk {kind} {name} index_bytes={index_bytes}")
        for name, x, levels, bucket, seed in qsgd_cases(rng, kind):
            eq, en = npref.qsgd_quantize(x, kind, levels, bucket, seed, flush)
            q, norms = core.quantize(x, kind, levels, bucket, seed)
            ok = np.array_equal(q, eq) and same_bits(
                norms.view(np.uint32), en.view(np.uint32), "float32"
            )
            out = core.dequantize(eq, en, levels, bucket, kind)
            ok &= same_bits(out, npref.qsgd_dequantize(eq, en, levels, bucket, kind, flush), kind)
            count += 1
            if not ok:
                failures.append(f"qsgd {kind} {name}")
        print(f"  {kind}: {count} cases", flush=True)
    if big_n:
        g = from_f64(rng.standard_normal(big_n), "float32")
        r = from_f64(rng.standard_normal(big_n), "float32")
        k = big_n // 100
        ev, ei, er = npref.topk_error_feedback(g, r, k, "float32", flush)
        v, i, out = core.topk(g, r, k, "float32", 4, True)
        if not (
            np.array_equal(i, ei) and same_bits(v, ev, "float32") and same_bits(out, er, "float32")
        ):
            failures.append(f"topk float32 n={big_n} k={k}")
        print(f"  float32 n={big_n} k={k}: checked", flush=True)
    return failures


def run_timing(core: CudaCore, n: int, density: float) -> None:
    """Fused op vs torch.topk plus residual ops vs copies of the op's minimal traffic."""
    torch = core.torch
    k = max(int(n * density), 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(n, device="cuda", generator=gen)
    r = torch.randn(n, device="cuda", generator=gen)
    ws = core.workspace(lambda s: core.lib.tfs_topk_workspace_bytes(2, n, k, s), "workspace")

    def fused_in_place():
        core.topk_device(g, r, r, k, "float32", 4, ws)

    out = torch.empty_like(r)

    def fused_new_buffer():
        core.topk_device(g, r, out, k, "float32", 4, ws)

    def torch_path():
        r.add_(g)
        _, idx = torch.topk(r.abs(), k, sorted=False)
        idx = torch.sort(idx).values
        values = r[idx]
        r[idx] = 0
        return values

    src = torch.empty(n * 3 // 2, device="cuda")
    dst = torch.empty_like(src)
    rows = [
        ("fused TopK + feedback (in place)", time_ms(torch, fused_in_place)),
        ("fused TopK + feedback (new residual)", time_ms(torch, fused_new_buffer)),
        ("torch.topk(abs) + sort + gather + scatter", time_ms(torch, torch_path)),
        ("copy of 6n bytes (12n bytes moved)", time_ms(torch, lambda: dst.copy_(src))),
        ("in-place add r += g (12n bytes)", time_ms(torch, lambda: r.add_(g))),
    ]
    fused, torch_t, copy_t = rows[0][1], rows[2][1], rows[3][1]
    print(f"\nTopK with error feedback, float32, n = {n:,}, k = {k:,} ({density:.1%})")
    for name, ms in rows:
        print(f"  {name:44s} {ms:9.3f} ms   {ms / fused:6.2f}x fused")
    print(
        f"  torch / fused = {torch_t / fused:.2f} (goal >= 2): "
        f"{'met' if torch_t / fused >= 2 else 'MISSED'}"
    )
    print(
        f"  fused / copy  = {fused / copy_t:.2f} (goal <= 3): "
        f"{'met' if fused / copy_t <= 3 else 'MISSED'}"
    )

    x = torch.randn(n, device="cuda", generator=gen)
    q = torch.empty(n, dtype=torch.int8, device="cuda")
    norms = torch.empty(npref.num_buckets(n, 512), device="cuda")
    qws, qsize = core.workspace(lambda s: core.lib.tfs_qsgd_workspace_bytes(n, 512, s), "ws")
    decoded = torch.empty_like(x)

    def quantize():
        core.check(
            core.lib.tfs_qsgd_quantize(
                2,
                core.ptr(x),
                n,
                127,
                512,
                1,
                core.ptr(q),
                core.ptr(norms),
                core.ptr(qws),
                qsize,
                core.stream(),
            ),
            "quantize",
        )

    def dequantize():
        core.check(
            core.lib.tfs_qsgd_dequantize(
                2, core.ptr(q), core.ptr(norms), n, 127, 512, core.ptr(decoded), core.stream()
            ),
            "dequantize",
        )

    print(f"\nQSGD float32, n = {n:,}, levels = 127, bucket = 512")
    for name, ms in (
        ("quantize", time_ms(torch, quantize)),
        ("dequantize", time_ms(torch, dequantize)),
    ):
        print(f"  {name:44s} {ms:9.3f} ms   {5 * n / ms / 1e6:7.1f} GB/s (5n bytes)")


def time_ms(torch, fn: Callable[[], object], iters: int = 20, warmup: int = 3) -> float:
    """Median milliseconds per call, by CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", help="path of libtfs_cuda.so")
    parser.add_argument("--tf-cpu", action="store_true", help="check the TF CPU kernels instead")
    parser.add_argument("--n", type=int, default=100_000_000, help="timing size")
    parser.add_argument("--skip-timing", action="store_true")
    args = parser.parse_args()
    start = time.monotonic()
    if args.tf_cpu:
        core, flush, big_n = TfCpuCore(), True, 0
    else:
        core, flush, big_n = CudaCore(args.lib), False, args.n
        props = core.torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB")
    print("correctness against the NumPy model:", flush=True)
    failures = run_correctness(core, flush, big_n)
    for f in failures:
        print(f"  FAILED: {f}")
    print(
        f"  {'all passed' if not failures else f'{len(failures)} FAILED'}"
        f" ({time.monotonic() - start:.0f} s)",
        flush=True,
    )
    if not args.tf_cpu and not args.skip_timing:
        for density in (0.01, 0.001):
            run_timing(core, args.n, density)
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
