"""Check the TF-free CUDA core against the NumPy model, then time it (no TensorFlow needed).

Run through ``run_gpu_checks.sh``, which builds ``libtfs_cuda.so`` first. Needs NumPy and
PyTorch with CUDA (device memory, streams, CUDA graphs and the torch.topk baseline). The model
is the ops' CPU semantics (denormal policy included), compared bit for bit, NaN payloads too
(ScatterSum: any NaN, where its result is defined bit for bit: at most two values per index,
or integer sums exact in any order; out-of-range indices skipped). All work runs on a
non-default stream; outputs and workspaces carry guard bytes; inputs are also handed
misaligned. Exit status 1 when any correctness case fails; performance goals are reported, not
enforced. ``--small`` runs only small cases (for compute-sanitizer).

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


def _load(name: str, path: Path):
    """The module at ``path`` imported as ``name`` (importing it from the tf_sparsify package
    would import TensorFlow)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The NumPy model imports the QSGD bucket sizes from the ops: that module first, by its name.
_load("tf_sparsify.ops.qsgd_buckets", ROOT / "tf_sparsify" / "ops" / "qsgd_buckets.py")
npref = _load("numpy_reference", ROOT / "tf_sparsify" / "testing" / "numpy_reference.py")

CODES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}
UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


class CudaCore:
    """ctypes bindings of libtfs_cuda.so on PyTorch device memory and a non-default stream.

    Every buffer the core writes is allocated with GUARD bytes after it (checked after each
    call); inputs are views one element into a larger buffer when ``misaligned``, and the
    workspace is handed 64 bytes into its allocation, as TensorFlow may hand them."""

    GUARD = 256

    def __init__(self, path: str) -> None:
        import torch

        self.torch = torch
        self.lib = lib = ctypes.CDLL(path)
        c_int, c_i64, c_ptr, c_size = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
        size_out = ctypes.POINTER(c_size)
        signatures = {
            "tfs_topk_workspace_bytes": [c_int, c_i64, c_i64, size_out],
            "tfs_topk_error_feedback": [c_int, c_ptr, c_ptr, c_ptr, c_i64, c_i64]
            + [c_ptr, c_ptr, c_int, c_ptr, c_size, c_ptr],
            "tfs_qsgd_workspace_bytes": [c_i64, c_i64, size_out],
            "tfs_qsgd_quantize": [c_int, c_ptr, c_i64, c_int, c_i64, c_i64]
            + [c_ptr, c_ptr, c_ptr, c_size, c_ptr],
            "tfs_qsgd_dequantize": [c_int, c_ptr, c_ptr, c_i64, c_int, c_i64, c_ptr, c_ptr],
            "tfs_scatter_sum": [c_int, c_ptr, c_ptr, c_int, c_i64, c_i64, c_ptr, c_ptr],
            "tfs_cuda_versions": [ctypes.POINTER(c_int), ctypes.POINTER(c_int)],
        }
        for name, args in signatures.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = c_int
        lib.tfs_error_string.argtypes = [c_int]
        lib.tfs_error_string.restype = ctypes.c_char_p
        self.dtypes = {
            "float16": torch.float16,
            "bfloat16": torch.bfloat16,
            "float32": torch.float32,
            "float64": torch.float64,
        }
        self.ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        self.stream = torch.cuda.Stream()  # never the default stream
        self.misaligned = False
        self._guarded: list = []

    def versions(self) -> str:
        runtime, driver = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.tfs_cuda_versions(ctypes.byref(runtime), ctypes.byref(driver)), "v")
        return f"built with CUDA runtime {runtime.value}, driver supports {driver.value}"

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: {self.lib.tfs_error_string(code).decode()}")

    @staticmethod
    def ptr(t) -> ctypes.c_void_p:
        return ctypes.c_void_p(t.data_ptr() if t.numel() else 0)

    def handle(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.stream.cuda_stream)

    def empty(self, count: int, dtype):
        """``count`` elements followed by GUARD bytes of 0xA5, registered for check_guards.

        Allocated and filled on self.stream, which the core's calls use: PyTorch's streams do
        not wait for the default stream, so a fill queued there could land after the call."""
        torch = self.torch
        size = torch.empty(0, dtype=dtype).element_size()
        with torch.cuda.stream(self.stream):
            raw = torch.full((count * size + self.GUARD,), 0xA5, dtype=torch.uint8, device="cuda")
        self._guarded.append((raw, count * size))
        return raw[: count * size].view(dtype)

    def check_guards(self) -> bool:
        self.stream.synchronize()
        ok = all(bool((raw[end:] == 0xA5).all()) for raw, end in self._guarded)
        self._guarded.clear()
        return ok

    def to_device(self, bits: np.ndarray, kind: str):
        """Device copy of a bit-pattern array (one element into its buffer when misaligned)."""
        torch = self.torch
        signed = torch.from_numpy(np.ascontiguousarray(bits).view(SIGNED[bits.itemsize]).copy())
        shift = 1 if self.misaligned else 0
        buf = torch.empty(bits.size + shift, dtype=signed.dtype, device="cuda")
        buf[shift:].copy_(signed)
        return buf[shift:].view(self.dtypes[kind])

    def to_host(self, t) -> np.ndarray:
        size = t.element_size()
        return t.view(self.ints[size]).cpu().numpy().view(UNSIGNED[size])

    def workspace(self, query: Callable[[ctypes.c_size_t], int], what: str):
        size = ctypes.c_size_t()
        self.check(query(ctypes.byref(size)), what)
        offset = 64 if self.misaligned else 0
        buf = self.empty(size.value + offset, self.torch.uint8)
        return buf[offset:], size

    def topk_device(self, g, r, out, k: int, kind: str, index_bytes: int, ws=None, outputs=None):
        """Queues the op on self.stream; returns (values, indices) tensors (``outputs`` when
        given, else new guarded ones)."""
        n = g.numel()
        if outputs is None:
            outputs = self.empty(k, g.dtype), self.empty(k, self.ints[index_bytes])
        values, indices = outputs
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
            self.handle(),
        )
        self.check(code, "tfs_topk_error_feedback")
        return values, indices

    def topk(self, g_bits, r_bits, k, kind, index_bytes=4, in_place=False):
        g, r = self.to_device(g_bits, kind), self.to_device(r_bits, kind)
        self.torch.cuda.synchronize()
        if in_place:
            out = r
        else:
            out = self.empty(r.numel() + (1 if self.misaligned else 0), r.dtype)
            out = out[1:] if self.misaligned else out
        with self.torch.cuda.stream(self.stream):
            values, indices = self.topk_device(g, r, out, k, kind, index_bytes)
        guards = self.check_guards()
        result = self.to_host(values), indices.cpu().numpy().astype(np.int64), self.to_host(out)
        return (*result, guards)

    def quantize(self, bits, kind, levels, bucket_size, seed):
        torch, n = self.torch, bits.size
        x = self.to_device(bits, kind)
        torch.cuda.synchronize()
        q = self.empty(n, torch.int8 if levels <= 127 else torch.int16)
        norms = self.empty(npref.num_buckets(n, bucket_size), torch.float32)
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
            self.handle(),
        )
        self.check(code, "tfs_qsgd_quantize")
        guards = self.check_guards()
        return q.cpu().numpy(), norms.cpu().numpy(), guards

    def dequantize(self, q, norms, levels, bucket_size, kind):
        torch = self.torch
        qd = torch.from_numpy(q.copy()).cuda()
        nd = torch.from_numpy(norms.copy()).cuda()
        torch.cuda.synchronize()
        out = self.empty(q.size, self.dtypes[kind])
        code = self.lib.tfs_qsgd_dequantize(
            CODES[kind],
            self.ptr(qd),
            self.ptr(nd),
            q.size,
            levels,
            bucket_size,
            self.ptr(out),
            self.handle(),
        )
        self.check(code, "tfs_qsgd_dequantize")
        guards = self.check_guards()
        return self.to_host(out), guards

    def scatter(self, value_bits, indices, n, kind, index_bytes=4):
        """dense[n] of tfs_scatter_sum (into a fresh, guarded buffer) and the guard check."""
        torch, shift = self.torch, 1 if self.misaligned else 0
        values = self.to_device(value_bits, kind)
        buf = torch.empty(indices.size + shift, dtype=self.ints[index_bytes], device="cuda")
        buf[shift:].copy_(torch.from_numpy(indices.astype(SIGNED[index_bytes])))
        dense = self.empty(n + shift, self.dtypes[kind])[shift:]
        torch.cuda.synchronize()
        code = self.lib.tfs_scatter_sum(
            CODES[kind],
            self.ptr(values),
            self.ptr(buf[shift:]),
            index_bytes,
            indices.size,
            n,
            self.ptr(dense),
            self.handle(),
        )
        self.check(code, "tfs_scatter_sum")
        guards = self.check_guards()
        return self.to_host(dense), guards


class TfCpuCore:
    """The same interface over the compiled TensorFlow CPU kernels (checks this harness)."""

    misaligned = False

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
        index_dtype = self.tf.int32 if index_bytes == 4 else self.tf.int64
        values, indices, out = self.ops.topk_error_feedback(g, r, k, index_dtype=index_dtype)
        return self.to_host(values), indices.numpy().astype(np.int64), self.to_host(out), True

    def quantize(self, bits, kind, levels, bucket_size, seed):
        q, norms = self.ops.qsgd_quantize(self.to_tensor(bits, kind), levels, bucket_size, seed)
        return q.numpy(), norms.numpy(), True

    def dequantize(self, q, norms, levels, bucket_size, kind):
        out = self.ops.qsgd_dequantize(q, norms, levels, bucket_size, [q.size], self.dtypes[kind])
        return self.to_host(out), True

    def scatter(self, value_bits, indices, n, kind, index_bytes=4):
        """The CPU kernel rejects out-of-range indices: they are dropped here, as the GPU does."""
        keep = (indices >= 0) & (indices < n)
        index_dtype = self.tf.int32 if index_bytes == 4 else self.tf.int64
        idx = self.tf.constant(indices[keep], index_dtype)
        dense = self.ops.scatter_sum(self.to_tensor(value_bits[keep], kind), idx, n)
        return self.to_host(dense), True


def from_f64(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float64":
        return x.astype(np.float64).view(np.uint64)
    with np.errstate(over="ignore"):
        if kind == "float16":
            return x.astype(np.float16).view(np.uint16)
        return npref.from_f32(x.astype(np.float32), kind)


TINY = {"float16": 2.0**-14, "bfloat16": 2.0**-126, "float32": 2.0**-126, "float64": 2.0**-1022}
BIG = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1e308}
NAN_BITS = {  # quiet NaN, negative NaN, NaN with a payload, for each kind
    "float16": (0x7E00, 0xFE00, 0x7E15),
    "bfloat16": (0x7FC0, 0xFFC0, 0x7FC5),
    "float32": (0x7FC00000, 0xFFC00000, 0x7FC01234),
    "float64": (0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000001234),
}
TIE_N, TIE_K = 3 * 2**20 + 5, 2**21 + 7


def topk_cases(rng: np.random.Generator, kind: str, small: bool):
    """(name, grad, residual, k) adversarial and random cases."""
    for n in (1, 7, 1023, 100003) + (() if small else ((1 << 20) + 3,)):
        g, r = from_f64(rng.standard_normal(n), kind), from_f64(rng.standard_normal(n), kind)
        for k in sorted({0, 1, max(n // 1000, 1), max(n // 100, 1), n // 8 + 1, n}):
            yield f"random n={n} k={k}", g, r, k
    n = 4099 if small else TIE_N
    zeros = from_f64(np.zeros(n), kind)
    ks = (1, n // 2, n) if small else (1, TIE_K, n - 1)
    for value in (0.0, -0.0, 1.5):
        for k in ks:
            yield f"all {value} n={n} k={k}", from_f64(np.full(n, value), kind), zeros, k
    few = from_f64(rng.integers(-3, 4, n).astype(np.float64), kind)
    for k in ks:
        yield f"ties at the threshold n={n} k={k}", few, zeros, k
    n = 70001 if not small else 4099
    zeros = from_f64(np.zeros(n), kind)
    signed_zeros = from_f64(np.where(rng.random(n) < 0.5, -0.0, 0.0), kind)
    yield "signed zeros", signed_zeros, signed_zeros, 10
    denormals = from_f64(rng.standard_normal(n) * TINY[kind] / 4, kind)
    for k in (1, 100, n // 2):
        yield f"denormal grads, zero residual k={k}", denormals, zeros, k
    x = rng.standard_normal(n)
    with np.errstate(over="ignore"):
        x[::7] *= BIG[kind]
    x[3::11] = TINY[kind] / 8
    x[5::13] = -TINY[kind] / 2
    x[1::17] = np.inf
    x[2::19] = -np.inf
    x[4::23] = np.nan
    small_r = from_f64(rng.standard_normal(n) * 1e-3, kind)
    for k in (1, int(np.isnan(x).sum()), n // 10):
        yield f"extremes k={k}", from_f64(x, kind), small_r, k
    g, r = from_f64(rng.standard_normal(n), kind), from_f64(rng.standard_normal(n), kind)
    quiet, negative, payload = NAN_BITS[kind]
    g[0::29], g[1::29], r[2::29] = quiet, negative, payload  # NaNs in one operand only
    g[3::31] = from_f64(np.array([np.inf]), kind)[0]
    r[3::31] = from_f64(np.array([-np.inf]), kind)[0]  # Inf + -Inf: NaN made by the add
    nans = len(range(0, n, 29)) * 3 + len(range(3, n, 31))
    for k in (nans // 3, nans - 1, nans + 5):
        yield f"NaN variants k={k}", g, r, k
    yield "n=0", g[:0], r[:0], 0


def qsgd_cases(rng: np.random.Generator, kind: str, small: bool):
    """(name, bits, levels, bucket_size, seed)."""
    sizes = [
        (0, 4, 0),
        (1, 1, 0),
        (7, 127, 3),
        (1023, 128, 0),
        (1023, 32767, 512),
        (100003, 4, 1500),  # 2048-wide padded buckets: 8 entries per thread
        (100003, 15, 0),
        (5000, 3, 7),
        (5000, 2, 2**40),  # bucket_size >> n: one bucket, no huge workspace
        (300001, 8, 1),
    ]
    if not small:
        sizes += [(1 << 20, 127, 4096), ((1 << 20) + 5, 8, 1500), ((1 << 22) + 3, 4, 1)]
    for n, levels, bucket in sizes:
        for seed in (0, 2**40 + 12345):
            x = from_f64(rng.standard_normal(n) * 3, kind)
            yield f"n={n} levels={levels} bucket={bucket} seed={seed}", x, levels, bucket, seed
    x = rng.standard_normal(3000)
    x[::10] = 0.0
    x[1::10] = -0.0
    x[2::97] = TINY[kind] / 4
    with np.errstate(over="ignore"):
        x[3::101] = BIG[kind]
    x[4::503] = np.nan
    x[5::607] = -np.inf
    for bucket in (0, 64, 100, 1500):
        yield f"special values bucket={bucket}", from_f64(x, kind), 8, bucket, 99
    denormals = from_f64(rng.standard_normal(2000) * TINY[kind] / 4, kind)
    yield "denormal inputs", denormals, 5, 16, 7


def scatter_cases(rng: np.random.Generator, kind: str, small: bool):
    """(name, value bits, indices, n): at most two values per index (exact on the GPU) except
    in the integer case, whose sums are exact in any order; out-of-range indices are skipped."""
    sizes = (1, 7, 1000, 100003) + (() if small else ((1 << 22) + 3,))
    for n in sizes:
        for density in (0.01, 0.3):
            k = max(int(n * density), 1)
            idx = np.concatenate([np.sort(rng.choice(n, k, replace=False)) for _ in range(2)])
            x = from_f64(rng.standard_normal(idx.size), kind)
            yield f"two replicas n={n} k={k}", x, idx, n
    n = 1000
    idx = rng.integers(0, n, 30000 if small else 300000)
    ints = from_f64(rng.integers(-1, 2, idx.size).astype(np.float64), kind)
    yield "contended integer sums", ints, idx, n
    tiny = TINY[kind]
    pairs = np.array([tiny / 4, -tiny / 4, 1.5 * tiny, -tiny, -0.0, -0.0, np.inf, -np.inf, 2.0])
    idx = np.array([0, 1, 2, 2, 3, 3, 4, 4, 5])
    nans = np.array(NAN_BITS[kind], npref.BITS[kind])
    bits = np.concatenate([from_f64(pairs, kind), nans])
    yield "denormals, signed zeros, Inf, NaN", bits, np.r_[idx, 6, 7, 7], 9
    outside = np.array([5, -1, 9, 2**31 - 1 if small else 2**40, 3, 0])
    yield "out-of-range indices skipped", from_f64(np.arange(6.0) + 1, kind), outside, 9
    yield "m = 0", from_f64(np.zeros(0), kind), np.zeros(0, np.int64), 5
    yield "n = 0", from_f64(np.zeros(0), kind), np.zeros(0, np.int64), 0


def same_bits(got: np.ndarray, want: np.ndarray, kind: str) -> bool:
    """Equal bit patterns, where NaN matches any NaN (the GPU's atomics give its own NaN)."""
    nan_got, nan_want = np.isnan(npref.to_f32(got, kind)), np.isnan(npref.to_f32(want, kind))
    return np.array_equal(nan_got, nan_want) and np.array_equal(got[~nan_got], want[~nan_want])


def first_difference(what: str, got: np.ndarray, want: np.ndarray, kind: str | None) -> str:
    """ "" when equal, else the first differing entry and how many differ. ``kind``: compare as
    bit patterns of that kind where any NaN matches any NaN; None: exactly."""
    if got.shape != want.shape:
        return f"{what}: shape {got.shape} != {want.shape}"
    differ = got != want
    if kind is not None:
        differ &= ~(np.isnan(npref.to_f32(got, kind)) & np.isnan(npref.to_f32(want, kind)))
    if not differ.any():
        return ""
    i = int(np.flatnonzero(differ)[0])
    show = hex if got.dtype.kind == "u" else int
    return f"{what}[{i}] = {show(got[i])} != {show(want[i])} ({int(differ.sum())} differ)"


def check_scatter(core, rng: np.random.Generator, kind: str, small: bool) -> list[str]:
    failures = []
    for count, (name, x, idx, n) in enumerate(scatter_cases(rng, kind, small)):
        keep = (idx >= 0) & (idx < n)
        want = npref.scatter_sum(x[keep], idx[keep], n, kind)
        index_bytes = 8 if count % 2 or idx.max(initial=0) >= 2**31 else 4
        core.misaligned = count % 3 == 1
        got, guards = core.scatter(x, idx, n, kind, index_bytes)
        if not (same_bits(got, want, kind) and guards):
            failures.append(
                f"scatter {kind} {name} index_bytes={index_bytes} misaligned={core.misaligned}"
                f"{'' if guards else ' GUARD BYTES OVERWRITTEN'}"
            )
    core.misaligned = False
    return failures


def run_correctness(core, small: bool, kinds: list[str]) -> list[str]:
    """Every case against the NumPy model (the ops' CPU semantics); returns the failures."""
    failures: list[str] = []
    for kind in kinds:
        rng = np.random.default_rng([2024, npref.KINDS.index(kind)])
        count = 0
        for name, g, r, k in topk_cases(rng, kind, small):
            ev, ei, er = npref.topk_error_feedback(g, r, k, kind)
            layouts = ((4, False, False), (8, True, True), (4, True, False), (8, False, True))
            for index_bytes, in_place, misaligned in layouts[: 2 if g.size > 200000 else 4]:
                core.misaligned = misaligned
                v, i, out, guards = core.topk(g, r, k, kind, index_bytes, in_place)
                ok = np.array_equal(i, ei) and np.array_equal(v, ev) and np.array_equal(out, er)
                count += 1
                if not (ok and guards):
                    failures.append(
                        f"topk {kind} {name} index_bytes={index_bytes} in_place={in_place} "
                        f"misaligned={misaligned}{'' if guards else ' GUARD BYTES OVERWRITTEN'}"
                    )
        for name, x, levels, bucket, seed in qsgd_cases(rng, kind, small):
            core.misaligned = count % 2 == 1
            eq, en = npref.qsgd_quantize(x, kind, levels, bucket, seed)
            q, norms, guards = core.quantize(x, kind, levels, bucket, seed)
            out, guards2 = core.dequantize(eq, en, levels, bucket, kind)
            want = npref.qsgd_dequantize(eq, en, levels, bucket, kind)
            # A NaN norm (a bucket with a NaN, or Inf beside Inf) and the NaNs it decodes to
            # match any NaN: the GPU's float64 and float32 arithmetic returns its own NaN.
            wrong = [
                first_difference("levels", q, eq, None),
                first_difference("norms", norms.view(np.uint32), en.view(np.uint32), "float32"),
                first_difference("decoded", out, want, kind),
                "" if guards and guards2 else "GUARD BYTES OVERWRITTEN",
            ]
            count += 1
            if any(wrong):
                failures.append(f"qsgd {kind} {name}: " + "; ".join(w for w in wrong if w))
        core.misaligned = False
        failures += check_scatter(core, rng, kind, small)
        print(f"  {kind}: {count} cases + scatter", flush=True)
    return failures


def run_device_checks(core: CudaCore, big_n: int) -> list[str]:
    """CUDA graph capture, n >= 2^31 refused, QSGD bucket_size 1 beyond 2^31 elements, and a
    large random case against the model."""
    torch, failures = core.torch, []
    n, k = 1 << 22, 1 << 15
    rng = np.random.default_rng(7)
    g_bits = from_f64(rng.standard_normal(n), "float32")
    r_bits = from_f64(rng.standard_normal(n), "float32")
    g, r = core.to_device(g_bits, "float32"), core.to_device(r_bits, "float32")
    ws = core.workspace(lambda s: core.lib.tfs_topk_workspace_bytes(2, n, k, s), "workspace")
    out = torch.empty_like(r)
    outputs = (
        torch.empty(k, dtype=torch.float32, device="cuda"),
        torch.empty(k, dtype=torch.int32, device="cuda"),
    )
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:  # capture fails on any synchronization, allocation or legacy-stream use
        with torch.cuda.graph(graph, stream=core.stream):
            values, indices = core.topk_device(g, r, out, k, "float32", 4, ws, outputs)
        graph.replay()
        torch.cuda.synchronize()
        ev, ei, er = npref.topk_error_feedback(g_bits, r_bits, k, "float32")
        got = (core.to_host(values), indices.cpu().numpy(), core.to_host(out))
        if not all(np.array_equal(a, b) for a, b in zip(got, (ev, ei, er), strict=True)):
            failures.append("topk in a captured CUDA graph: wrong result")
    except RuntimeError as err:
        failures.append(f"topk in a captured CUDA graph: {err}")
    core._guarded.clear()
    null = ctypes.c_void_p()
    size = ctypes.c_size_t()
    if core.lib.tfs_topk_workspace_bytes(2, 2**31, 5, ctypes.byref(size)) != -1:
        failures.append("topk with n = 2^31 not refused")
    if core.lib.tfs_qsgd_workspace_bytes(10, 2**62 + 1, ctypes.byref(size)) or size.value > 4096:
        failures.append(f"qsgd workspace for bucket_size 2^62+1, n=10: {size.value} bytes")
    del null
    if big_n:  # bucket_size 1: norm = |x|, level = sign(x) * levels, checked on the device
        x = torch.randn(big_n, device="cuda", dtype=torch.float16)
        q = torch.empty(big_n, dtype=torch.int8, device="cuda")
        norms = torch.empty(big_n, dtype=torch.float32, device="cuda")
        ws = core.workspace(lambda s: core.lib.tfs_qsgd_workspace_bytes(big_n, 1, s), "ws")
        torch.cuda.synchronize()  # x was written on the default stream
        code = core.lib.tfs_qsgd_quantize(
            0,
            core.ptr(x),
            big_n,
            5,
            1,
            3,
            core.ptr(q),
            core.ptr(norms),
            core.ptr(ws[0]),
            ws[1],
            core.handle(),
        )
        core.check(code, "quantize bucket_size=1")
        core.stream.synchronize()
        want_norms = x.float().abs()
        want_levels = (torch.sign(x.float()) * 5).to(torch.int8)
        norms_ok = torch.equal(norms, want_norms)
        levels_ok = torch.equal(q, want_levels)
        guards = core.check_guards()
        if not (norms_ok and levels_ok and guards):
            bad = (norms != want_norms) | (q != want_levels)
            where = bad.nonzero()[:1].flatten().tolist()
            failures.append(
                f"first wrong index {where}: x = {x[where].tolist()}, norm = "
                f"{norms[where].tolist()}, level = {q[where].tolist()}"
            )
            failures.append(
                f"qsgd float16 bucket_size=1 n={big_n}: norms {'ok' if norms_ok else 'WRONG'}, "
                f"levels {'ok' if levels_ok else 'WRONG'}, guards {'ok' if guards else 'WRONG'}"
            )
        del x, q, norms, ws, want_norms, want_levels
        torch.cuda.empty_cache()
    return failures


def run_timing(core: CudaCore, n: int, density: float, kind: str) -> None:
    """Fused op vs torch.topk plus residual ops vs copies of the op's minimal traffic."""
    torch = core.torch
    dtype = core.dtypes[kind]
    k = max(int(n * density), 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    g = torch.randn(n, device="cuda", generator=gen).to(dtype)
    r = torch.randn(n, device="cuda", generator=gen).to(dtype)
    ws = core.workspace(
        lambda s: core.lib.tfs_topk_workspace_bytes(CODES[kind], n, k, s), "workspace"
    )
    out = torch.empty_like(r)
    values = torch.empty(k, dtype=dtype, device="cuda")
    indices = torch.empty(k, dtype=torch.int32, device="cuda")

    def fused(target, k=k):
        core.check(
            core.lib.tfs_topk_error_feedback(
                CODES[kind],
                core.ptr(g),
                core.ptr(r),
                core.ptr(target),
                n,
                k,
                core.ptr(values),
                core.ptr(indices),
                4,
                core.ptr(ws[0]),
                ws[1],
                core.handle(),
            ),
            "topk",
        )

    def torch_path():
        r.add_(g)
        _, idx = torch.topk(r.abs(), k, sorted=False)
        idx = torch.sort(idx).values
        picked = r[idx]
        r[idx] = 0
        return picked

    src = torch.empty(n * 3 * g.element_size() // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    torch.cuda.synchronize()  # inputs and workspace were written on other streams
    with torch.cuda.stream(core.stream):
        rows = [
            ("fused TopK + feedback (in place)", time_ms(torch, lambda: fused(r))),
            ("fused TopK + feedback (new residual)", time_ms(torch, lambda: fused(out))),
            ("its add alone (k = 0, no selection)", time_ms(torch, lambda: fused(out, 0))),
            ("torch.topk(abs) + sort + gather + scatter", time_ms(torch, torch_path)),
            ("device copy of 3n elements' bytes", time_ms(torch, lambda: dst.copy_(src))),
        ]
    fused_ms, torch_ms, copy_ms = rows[0][1], rows[3][1], rows[4][1]
    print(f"\nTopK with error feedback, {kind}, n = {n:,}, k = {k:,} ({density:.1%})")
    for name, ms in rows:
        print(f"  {name:44s} {ms:9.3f} ms   {ms / fused_ms:6.2f}x fused")
    print(
        f"  torch / fused = {torch_ms / fused_ms:.2f} (goal >= 2), "
        f"fused / copy = {fused_ms / copy_ms:.2f} (goal <= 3)"
    )


def run_qsgd_timing(core: CudaCore, n: int) -> None:
    torch = core.torch
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(n, device="cuda", generator=gen)
    q = torch.empty(n, dtype=torch.int8, device="cuda")
    decoded = torch.empty_like(x)
    torch.cuda.synchronize()
    for bucket in (512, 1500, 0):
        print(f"\nQSGD float32, n = {n:,}, levels = 127, bucket = {bucket}")
        with torch.cuda.stream(core.stream):
            for name, ms in _qsgd_times(core, x, q, decoded, bucket):
                print(f"  {name:44s} {ms:9.3f} ms   {5 * n / ms / 1e6:7.1f} GB/s (5n bytes)")
        core._guarded.clear()


def _qsgd_times(core: CudaCore, x, q, decoded, bucket: int) -> list[tuple[str, float]]:
    n = x.numel()
    norms = core.torch.empty(npref.num_buckets(n, bucket), device="cuda")
    ws, size = core.workspace(lambda s: core.lib.tfs_qsgd_workspace_bytes(n, bucket, s), "ws")
    quantize = (
        core.lib.tfs_qsgd_quantize,
        (2, core.ptr(x), n, 127, bucket, 1, core.ptr(q), core.ptr(norms), core.ptr(ws), size),
    )
    dequantize = (
        core.lib.tfs_qsgd_dequantize,
        (2, core.ptr(q), core.ptr(norms), n, 127, bucket, core.ptr(decoded)),
    )
    return [
        (name, time_ms(core.torch, lambda f=f, a=a, w=name: core.check(f(*a, core.handle()), w)))
        for name, (f, a) in (("quantize", quantize), ("dequantize", dequantize))
    ]


def run_scatter_timing(core: CudaCore, n: int, density: float, kind: str) -> None:
    """tfs_scatter_sum of two replicas' TopK payloads vs torch's index_add_ and scatter_add_
    (after zeroing, as the op does) vs zeroing and copying the output's bytes."""
    torch = core.torch
    k = max(int(n * density), 1)
    gen = torch.Generator(device="cuda").manual_seed(2)
    perms = [torch.randperm(n, device="cuda", generator=gen)[:k].sort().values for _ in "ab"]
    idx64 = torch.cat(perms)
    idx32 = idx64.to(torch.int32)
    values = torch.randn(2 * k, device="cuda", generator=gen).to(core.dtypes[kind])
    dense = torch.empty(n, dtype=values.dtype, device="cuda")
    src = torch.empty_like(dense)
    torch.cuda.synchronize()

    def fused():
        code = core.lib.tfs_scatter_sum(
            CODES[kind],
            core.ptr(values),
            core.ptr(idx32),
            4,
            2 * k,
            n,
            core.ptr(dense),
            core.handle(),
        )
        core.check(code, "scatter")

    with torch.cuda.stream(core.stream):
        rows = [
            ("tfs_scatter_sum (zero + atomic adds)", time_ms(torch, fused)),
            (
                "zero_ + torch index_add_",
                time_ms(torch, lambda: dense.zero_().index_add_(0, idx64, values)),
            ),
            (
                "zero_ + torch scatter_add_",
                time_ms(torch, lambda: dense.zero_().scatter_add_(0, idx64, values)),
            ),
            ("zero_ of n elements", time_ms(torch, dense.zero_)),
            ("device copy of n elements", time_ms(torch, lambda: dense.copy_(src))),
        ]
    print(f"\nScatterSum, {kind}, n = {n:,}, 2 replicas x k = {k:,} ({density:.1%})")
    for name, ms in rows:
        print(f"  {name:44s} {ms:9.3f} ms   {ms / rows[0][1]:6.2f}x fused")


def time_ms(torch, fn: Callable[[], object], iters: int = 10, warmup: int = 2) -> float:
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
    parser.add_argument("--big-n", type=int, default=2**31 + 5, help="QSGD bucket_size=1 size")
    parser.add_argument("--small", action="store_true", help="small cases only (sanitizers)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument(
        "--kinds", default=",".join(npref.KINDS), help="dtypes of the correctness cases"
    )
    args = parser.parse_args()
    start = time.monotonic()
    if args.tf_cpu:
        core = TfCpuCore()
    else:
        core = CudaCore(args.lib)
        props = core.torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB; {core.versions()}")
    print("correctness against the NumPy model (the CPU kernels' semantics):", flush=True)
    failures = run_correctness(core, args.small, args.kinds.split(","))
    if not args.tf_cpu:
        failures += run_device_checks(core, 0 if args.small else args.big_n)
    for f in failures:
        print(f"  FAILED: {f}")
    print(
        f"  {'all passed' if not failures else f'{len(failures)} FAILED'}"
        f" ({time.monotonic() - start:.0f} s)",
        flush=True,
    )
    if not (args.tf_cpu or args.small or args.skip_timing):
        for kind in npref.KINDS:
            for density in (0.01, 0.001):
                run_timing(core, args.n, density, kind)
        run_qsgd_timing(core, args.n)
        for kind in ("float32", "float16"):
            for density in (0.01, 0.001):
                run_scatter_timing(core, args.n, density, kind)
    print(f"\ntotal {time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
