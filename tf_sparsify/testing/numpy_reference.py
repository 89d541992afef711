"""NumPy model of the custom ops, independent of TensorFlow (the GPU check loads it by path,
and :mod:`tf_sparsify.ops.qsgd_buckets`, the QSGD bucket sizes it shares with the ops, before it).

Arrays are raw IEEE bit patterns (uint16 for float16 and bfloat16, uint32, uint64) plus a
``kind`` naming the float type, so bfloat16 needs no NumPy support. It follows the ops'
denormal policy (see :mod:`tf_sparsify.ops.pure_tf`), that of TensorFlow's CPU threads
(x86 DAZ and FTZ): float32, float64 and bfloat16 (computed in float32) arithmetic sees denormal
inputs as zero and flushes results that, rounded with an unbounded exponent, are below the
smallest normal; float16 arithmetic (computed in float32, where its denormals are normal) is
unaffected. QSGD saturates as the ops do.
"""

from __future__ import annotations

import numpy as np

from tf_sparsify.ops.qsgd_buckets import effective_bucket, num_buckets

KINDS = ("float16", "bfloat16", "float32", "float64")
BITS = {"float16": np.uint16, "bfloat16": np.uint16, "float32": np.uint32, "float64": np.uint64}
#: the NumPy type of each kind but bfloat16 (which NumPy lacks: bit patterns only)
FLOATS = {"float16": np.float16, "float32": np.float32, "float64": np.float64}
_SIGN_MASK = {"float16": 0x7FFF, "bfloat16": 0x7FFF, "float32": 0x7FFFFFFF}
F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)
# Exact results below this magnitude round (unbounded exponent) below F32_TINY: flushed.
F32_FLUSH_BELOW = F32_TINY * (1 - 2.0**-25)
OUTPUT_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}


def _flush(x: np.ndarray) -> np.ndarray:
    """Denormals of a float32/float64 array replaced by zeros of the same sign."""
    tiny = np.finfo(x.dtype).tiny
    return np.where(np.abs(x) < tiny, np.copysign(np.zeros_like(x), x), x)


def divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """float32 ``a / b`` (normal or zero operands, ``b > 0``), flushed by the FTZ rule."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        q = (a / b).astype(np.float32)
        exact_below = np.abs(a.astype(np.float64)) < b.astype(np.float64) * F32_FLUSH_BELOW
    small = (np.abs(q) < F32_TINY) | ((np.abs(q) == F32_TINY) & exact_below)
    return np.where(small, np.copysign(np.float32(0), q), q)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns to float32 (exact)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bit patterns, round to nearest even; NaN becomes 0x7FC0 | sign."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.where(u >> 31, np.uint16(0xFFC0), np.uint16(0x7FC0))
    return np.where(np.isnan(x), nan, rounded)


def to_f32(bits: np.ndarray, kind: str) -> np.ndarray:
    """Values of ``kind`` as float32 (float64 rounds to nearest even)."""
    if kind == "bfloat16":
        return bf16_to_f32(bits)
    with np.errstate(over="ignore"):
        return bits.view(FLOATS[kind]).astype(np.float32)  # a copy, also from float32


def qsgd_input(bits: np.ndarray, kind: str) -> np.ndarray:
    """QSGD's float32 view of the input: denormals flushed, finite values beyond float32's
    range saturated, float64 rounded by the FTZ rule."""
    if kind == "float16":
        return to_f32(bits, kind)
    if kind != "float64":
        return _flush(to_f32(bits, kind))
    d = bits.view(np.float64)
    clipped = np.where(np.isfinite(d), np.clip(d, -F32_MAX, F32_MAX), d).astype(np.float32)
    return np.where(np.abs(d) < F32_FLUSH_BELOW, np.copysign(np.float32(0), clipped), clipped)


def from_f32(x: np.ndarray, kind: str) -> np.ndarray:
    """float32 values to bit patterns of ``kind`` (round to nearest even)."""
    if kind == "bfloat16":
        return f32_to_bf16(x)
    return x.astype(FLOATS[kind]).view(BITS[kind])


def add(a: np.ndarray, b: np.ndarray, kind: str) -> np.ndarray:
    """``a + b`` in ``kind``, correctly rounded (16-bit kinds add in float32, then round).

    Sums of normal numbers are exact when they are denormal, so flushing after the add is
    the FTZ rule here."""
    with np.errstate(invalid="ignore", over="ignore"):
        if kind == "bfloat16":
            return f32_to_bf16(_flush(_flush(bf16_to_f32(a)) + _flush(bf16_to_f32(b))))
        if kind == "float16":
            return (a.view(np.float16) + b.view(np.float16)).view(np.uint16)
        ftype = np.float32 if kind == "float32" else np.float64
        s = _flush(_flush(a.view(ftype)) + _flush(b.view(ftype)))
    return s.view(BITS[kind])


def magnitude_keys(bits: np.ndarray, kind: str) -> np.ndarray:
    """Sign-masked bit patterns as int64 (NaN above +Inf, +0.0 == -0.0)."""
    if kind == "float64":
        return (bits & np.uint64(0x7FFFFFFFFFFFFFFF)).view(np.int64)
    return (bits & BITS[kind](_SIGN_MASK[kind])).astype(np.int64)


def topk_select(keys: np.ndarray, k: int) -> np.ndarray:
    """Ascending indices of the k largest keys, ties to the lowest index, in O(n)."""
    n = keys.size
    if k == 0:
        return np.zeros(0, np.int64)
    kth = np.partition(keys, n - k)[n - k]
    above = np.flatnonzero(keys > kth)
    ties = np.flatnonzero(keys == kth)[: k - above.size]
    return np.sort(np.concatenate([above, ties]))


def topk_error_feedback(
    grad: np.ndarray, residual: np.ndarray, k: int, kind: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(values, indices, new_residual)`` as bit patterns (indices int64), flat."""
    acc = add(grad.ravel(), residual.ravel(), kind)
    indices = topk_select(magnitude_keys(acc, kind), k)
    new = acc.copy()
    new[indices] = 0
    return acc[indices], indices, new


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def hash_uniform(seed: int, n: int) -> np.ndarray:
    """``(fmix32(fmix32(i ^ key0) ^ key1) >> 8) * 2**-24`` (float32), i = flat index mod 2**32."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    key0, key1 = np.uint32(s & 0xFFFFFFFF), np.uint32(s >> 32)
    i = (np.arange(n, dtype=np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = _fmix32(_fmix32(i ^ key0) ^ key1)
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


def _buckets(x: np.ndarray, bucket_size: int) -> np.ndarray:
    n = x.size
    b = effective_bucket(n, bucket_size)
    padded = np.zeros(num_buckets(n, bucket_size) * b, x.dtype)
    padded[:n] = x
    return padded.reshape(-1, b)


def bucket_norms(x32: np.ndarray, bucket_size: int) -> np.ndarray:
    """float32 norms: float64 squares, zero-padded to a power of two, added in adjacent pairs;
    a finite norm above float32's max saturates."""
    buckets = _buckets(x32, bucket_size).astype(np.float64)
    width = 1 << max(buckets.shape[1] - 1, 0).bit_length()
    s = np.zeros((buckets.shape[0], width))
    with np.errstate(invalid="ignore", over="ignore"):
        s[:, : buckets.shape[1]] = buckets * buckets
        while s.shape[1] > 1:
            s = s[:, 0::2] + s[:, 1::2]
    norms = np.sqrt(s[:, 0])
    return np.where(np.isfinite(norms), np.minimum(norms, F32_MAX), norms).astype(np.float32)


def qsgd_quantize(
    bits: np.ndarray, kind: str, levels: int, bucket_size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(signed_levels, norms)``: int8 levels for ``levels <= 127`` else int16, flat."""
    x = qsgd_input(bits.ravel(), kind)
    n = x.size
    norms = bucket_norms(x, bucket_size)
    safe = np.where(norms > 0, norms, np.float32(1))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ratio = divide(np.abs(_buckets(x, bucket_size)), safe[:, None])
        ratio = (ratio * np.float32(levels)).ravel()[:n]
        floor = np.floor(ratio)
        up = (hash_uniform(seed, n) < ratio - floor).astype(np.float32)
        level = np.minimum(floor + up, np.float32(levels))
    signed = np.where(x < 0, -level, level)
    signed = np.where(np.isnan(signed), np.float32(0), signed)
    return signed.astype(np.int8 if levels <= 127 else np.int16), norms


def qsgd_dequantize(
    signed_levels: np.ndarray, norms: np.ndarray, levels: int, bucket_size: int, kind: str
) -> np.ndarray:
    """Bit patterns of ``kind``: ``signed_level * (norm / levels)`` in float32, clamped to the
    largest finite magnitude of ``kind``, then rounded."""
    q = signed_levels.ravel().astype(np.float32)
    n = q.size
    scale = divide(_flush(norms.astype(np.float32)), np.full(norms.size, levels, np.float32))
    top = np.float32(OUTPUT_MAX.get(kind, F32_MAX))
    with np.errstate(invalid="ignore", over="ignore"):
        out = (_buckets(q, bucket_size) * scale[:, None]).ravel()[:n]
    clamped = np.where(out > top, top, np.where(out < -top, -top, out))
    return from_f32(clamped, kind)


def scatter_sum(values: np.ndarray, indices: np.ndarray, n: int, kind: str) -> np.ndarray:
    """Bit patterns of ``kind``, ``[n]``: zeros plus ``values`` (bit patterns) added at
    ``indices`` in input order with :func:`add`; ValueError for an index outside ``[0, n)``."""
    indices = np.asarray(indices, np.int64).ravel()
    bad = np.flatnonzero((indices < 0) | (indices >= n))
    if bad.size:
        raise ValueError(f"indices[{bad[0]}] = {indices[bad[0]]} is out of range [0, {n})")
    out = np.zeros(n, BITS[kind])
    order = np.argsort(indices, kind="stable")
    first = np.flatnonzero(np.r_[True, np.diff(indices[order]) != 0])
    # rank[t]: how many entries with the same index come before order[t] in input order
    rank = np.arange(indices.size) - np.repeat(first, np.diff(np.r_[first, indices.size]))
    for r in range(int(rank.max(initial=-1)) + 1):  # one round per rank: distinct indices
        pick = order[rank == r]
        out[indices[pick]] = add(out[indices[pick]], values.ravel()[pick], kind)
    return out


def index_code_bits(n: int, k: int, low_bits: int) -> tuple[int, int]:
    """``(map bits, code bytes)`` of the Elias-Fano code of ``k`` of ``n`` indices with
    ``low_bits``-bit low parts (layout: :mod:`tf_sparsify.ops.index_code`)."""
    high = ((n - 1) >> low_bits) + k if k else 0
    return high, -(-(high + k * low_bits) // 8)


def index_code_encode(indices: np.ndarray, n: int, low_bits: int) -> np.ndarray:
    """``IndexCodeEncode``: the uint8 code of strictly ascending ``indices`` in ``[0, n)``;
    ValueError naming the first index that is out of range or not above the one before."""
    x = np.asarray(indices, np.int64).ravel()
    k = x.size
    bad = np.flatnonzero((x < 0) | (x >= n))
    if bad.size:
        raise ValueError(f"indices[{bad[0]}] = {x[bad[0]]} is out of range [0, {n})")
    down = np.flatnonzero(np.diff(x) <= 0)
    if down.size:
        j = down[0]
        raise ValueError(
            f"indices must be strictly ascending, got indices[{j}] = {x[j]} and "
            f"indices[{j + 1}] = {x[j + 1]}"
        )
    high, size = index_code_bits(n, k, low_bits)
    bits = np.zeros(8 * size, np.uint8)
    bits[(x >> low_bits) + np.arange(k)] = 1
    if low_bits:
        low = (x[:, None] >> np.arange(low_bits)) & 1
        bits[high : high + k * low_bits] = low.ravel()
    return np.packbits(bits, bitorder="little")


def index_code_decode(code: np.ndarray, n: int, k: int, low_bits: int) -> np.ndarray:
    """``IndexCodeDecode``: ``code[..., bytes]`` (uint8) gives int64 ``[..., k]`` indices.

    Only the code of ``k`` strictly ascending indices below ``n`` decodes (the rows that
    :func:`index_code_encode` gives): a row whose map does not hold exactly ``k`` ones, that
    decodes an index ``>= n`` or indices that do not ascend, or that has a padding bit set
    raises ValueError naming the row.
    """
    code = np.asarray(code)
    high, size = index_code_bits(n, k, low_bits)
    if code.dtype != np.uint8 or code.ndim == 0 or code.shape[-1] != size:
        raise ValueError(
            f"code must be uint8 with {size} bytes on its last axis (k = {k} of {n} indices), "
            f"got dtype {code.dtype}, shape {code.shape}"
        )
    if size == 0:  # k = 0: nothing to decode
        return np.zeros(code.shape[:-1] + (k,), np.int64)
    rows = code.reshape(-1, size)
    out = np.zeros((rows.shape[0], k), np.int64)
    weights = np.int64(1) << np.arange(low_bits, dtype=np.int64)
    for r, row in enumerate(rows):
        bits = np.unpackbits(row, bitorder="little").astype(np.int64)
        ones = np.flatnonzero(bits[:high])
        if ones.size != k:
            raise ValueError(f"code row {r} holds {ones.size} map ones, expected k = {k}")
        lows = bits[high : high + k * low_bits].reshape(k, low_bits) @ weights
        x = ((ones - np.arange(k)) << low_bits) | lows
        bad = np.flatnonzero(x >= n)
        if bad.size:
            raise ValueError(
                f"code row {r} decodes index {bad[0]} to {x[bad[0]]}, out of range [0, {n})"
            )
        down = np.flatnonzero(np.diff(x) <= 0)
        if down.size:
            j = down[0]
            raise ValueError(
                f"code row {r} decodes index {j} to {x[j]} and index {j + 1} to {x[j + 1]}, "
                "not strictly ascending"
            )
        if bits[high + k * low_bits :].any():
            raise ValueError(f"code row {r} has padding bits set after bit {high + k * low_bits}")
        out[r] = x
    return out.reshape(code.shape[:-1] + (k,))


def to_wire(v: np.ndarray, kind: str) -> np.ndarray:
    """float32 ``v`` (no denormals) as ``kind`` bits (float16 or bfloat16), round to nearest
    even, finite values beyond the range saturated; NaN as TensorFlow's Cast gives it (float16:
    sign and top payload bits, quiet bit set; bfloat16: 0x7FC0)."""
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.float32(OUTPUT_MAX[kind])
        clipped = np.where(np.isfinite(v), np.clip(v, -top, top), v).astype(np.float32)
        u = v.view(np.uint32)
        if kind == "bfloat16":
            return np.where(np.isnan(v), np.uint16(0x7FC0), f32_to_bf16(clipped))
        nan = ((u >> 16) & 0x8000) | 0x7E00 | ((u >> 13) & 0x3FF)
        return np.where(
            np.isnan(v), nan.astype(np.uint16), clipped.astype(np.float16).view(np.uint16)
        )


def saturating_cast_feedback(
    grad: np.ndarray, residual: np.ndarray | None, kind: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(wire, new_residual)`` bits of the fused cast for float32 bits ``grad`` and
    ``residual`` (None: no residual, and None back); ``kind`` is the wire type."""
    if residual is None:
        v = _flush(grad.view(np.float32))
    else:
        v = add(grad, residual, "float32").view(np.float32)
    wire = to_wire(v, kind)
    if residual is None:
        return wire, None
    with np.errstate(invalid="ignore"):
        new = _flush(v - to_f32(wire, kind))
    return wire, new.view(np.uint32)


def wire_to_float(wire: np.ndarray, scale: float, kind: str) -> tuple[np.ndarray, bool]:
    """``(float32 bits of float(wire) * scale, every entry finite)`` for ``kind`` bits."""
    values = _flush(to_f32(wire, kind))
    with np.errstate(invalid="ignore", over="ignore"):
        product = _flush(values * np.float32(scale))
    return product.view(np.uint32), bool(np.isfinite(values).all())
