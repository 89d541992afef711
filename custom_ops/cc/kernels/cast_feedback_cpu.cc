// CPU kernels of SaturatingCastFeedback, float32 to a 16-bit wire type (float16 or bfloat16)
// with error feedback in one pass over memory, of WireToFloat, its way back (scaled, with a
// finiteness check in the same pass), and of WireSum, the sum of gathered 16-bit payloads over
// their first axis (accumulated in float32, rounded once, in one pass).
//
// v = grad + residual (grad alone without a residual); wire = v rounded to nearest even, finite
// values beyond the wire type's range saturated to its largest finite value, Inf kept, NaN
// quieted as TensorFlow's Cast does (float16: sign and top payload bits kept, quiet bit set;
// bfloat16: 0x7FC0); new_residual = v - float(wire).
//
// Paths: F16C (float16) and AVX512-BF16 (bfloat16) where the CPU has them, chosen at run time
// (the build targets x86-64-v2); elsewhere, and when the op's `portable` attr asks for it, a
// portable path on the bit patterns that the compiler vectorizes (for AVX2 where the CPU has
// it). Both give the same bits; the vector loops leave their last partial vector to the
// portable code.
//
// Everything runs under DAZ/FTZ (ScopedFlushDenormal), the ops' denormal policy: denormal
// inputs read as zero and a denormal new_residual entry is flushed (keeping its sign).
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"
#include "cpu_parallel.h"
#include "f16c.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

constexpr int64_t kMinChunk = int64_t{1} << 16;  // entries per thread, at least
// From this many entries on, the float32 output (4 bytes an entry, far beyond the caches) is
// written with non-temporal stores, which skip reading its cache lines first.
constexpr int64_t kMinStreamed = int64_t{1} << 20;
constexpr int64_t kChunkAlign = 16;  // chunks start at multiples of 64 bytes of float32

// [Begin(c), End(c)) for c < count: contiguous chunks of [0, n) starting at multiples of
// kChunkAlign, so that a 64-byte aligned float32 buffer is aligned at every chunk.
struct AlignedChunks {
  int64_t n;
  int64_t count;
  int64_t Size() const {
    return ((n + count - 1) / count + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  }
  int64_t Begin(int64_t c) const { return std::min(n, c * Size()); }
  int64_t End(int64_t c) const { return std::min(n, (c + 1) * Size()); }
};

// Whether the output of n entries at out is streamed (64-byte aligned and large).
inline bool Streamed(const void* out, int64_t n) {
  return n >= kMinStreamed && reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

inline uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float FloatOf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// c ? a : b without a branch (so that the loops below vectorize).
inline uint32_t Pick(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// u with a denormal value replaced by a zero of its sign.
inline uint32_t Flushed(uint32_t u) { return Pick((u & 0x7F800000u) == 0, u & 0x80000000u, u); }

// float16 bits of the float32 of bits u (no denormal), round to nearest even; finite values
// that round beyond float16's range saturate to its largest finite value (kSaturate) or give Inf.
template <bool kSaturate>
inline uint16_t HalfBits(uint32_t u) {
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t rebiased = a - 0x38000000u;  // exponent bias 127 -> 15 (normal results)
  const uint32_t normal = (rebiased + 0xFFFu + ((rebiased >> 13) & 1u)) >> 13;
  // below 2^-14: adding 0.5 makes the float32 sum round at 2^-24, float16's subnormal step
  const uint32_t subnormal = BitsOf(FloatOf(a) + 0.5f) - 0x3F000000u;
  uint32_t h = Pick(a < 0x38800000u, subnormal, normal);
  h = Pick(a >= 0x477FF000u, kSaturate ? 0x7BFFu : 0x7C00u, h);  // 65520 and above round to Inf
  h = Pick(a == 0x7F800000u, 0x7C00u, h);
  h = Pick(a > 0x7F800000u, 0x7E00u | ((a >> 13) & 0x3FFu), h);
  return static_cast<uint16_t>(sign | h);
}

// The float32 value of float16 bits h.
inline float HalfValue(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t a = h & 0x7FFFu;
  const uint32_t normal = (a << 13) + 0x38000000u;
  const uint32_t special = (a << 13) | 0x7F800000u;
  const uint32_t subnormal = BitsOf(static_cast<float>(static_cast<int32_t>(a)) * 0x1p-24f);
  uint32_t bits = Pick(a < 0x400u, subnormal, normal);
  bits = Pick(a >= 0x7C00u, special, bits);
  return FloatOf(sign | bits);
}

// bfloat16 bits of the float32 of bits u (no denormal), round to nearest even; finite values
// that round beyond bfloat16's range saturate to its largest finite value (kSaturate) or give
// Inf; NaN gives 0x7FC0.
template <bool kSaturate>
inline uint16_t Bf16Bits(uint32_t u) {
  const uint32_t a = u & 0x7FFFFFFFu;
  uint32_t h = (a + 0x7FFFu + ((a >> 16) & 1u)) >> 16;  // beyond the range: 0x7F80, Inf
  if constexpr (kSaturate) h = Pick(a >= 0x7F7F8000u, 0x7F7Fu, h);
  h = Pick(a == 0x7F800000u, 0x7F80u, h);
  h |= (u >> 16) & 0x8000u;
  h = Pick(a > 0x7F800000u, 0x7FC0u, h);
  return static_cast<uint16_t>(h);
}

inline float Bf16Value(uint32_t h) { return FloatOf(h << 16); }

// The portable path over [0, len).
template <bool kHalf, bool kFeedback>
__attribute__((always_inline)) inline void CastPortable(const float* __restrict__ grad,
                                                        const float* __restrict__ residual,
                                                        uint16_t* __restrict__ wire,
                                                        float* __restrict__ new_residual,
                                                        int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    // with a residual, DAZ/FTZ keep the sum free of denormals
    const float v = kFeedback ? grad[i] + residual[i] : FloatOf(Flushed(BitsOf(grad[i])));
    const uint16_t w = kHalf ? HalfBits<true>(BitsOf(v)) : Bf16Bits<true>(BitsOf(v));
    wire[i] = w;
    if constexpr (kFeedback) new_residual[i] = v - (kHalf ? HalfValue(w) : Bf16Value(w));
  }
}

// out[0:len] = float(wire) * scale (the portable path); whether every entry of wire is finite.
template <bool kHalf>
__attribute__((always_inline)) inline bool WidenPortable(const uint16_t* __restrict__ wire,
                                                         float scale, float* __restrict__ out,
                                                         int64_t len) {
  const uint32_t exponent = kHalf ? 0x7C00u : 0x7F80u;
  uint32_t special = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t h = wire[i];
    out[i] = (kHalf ? HalfValue(h) : Bf16Value(h)) * scale;
    special |= static_cast<uint32_t>((h & exponent) == exponent);
  }
  return special == 0;
}

#if defined(__x86_64__)
inline bool HasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}

// The portable path compiled for AVX2 (bfloat16 on the many CPUs without AVX512-BF16).
template <bool kHalf, bool kFeedback>
__attribute__((target("avx2"))) void CastPortableAvx2(const float* grad, const float* residual,
                                                       uint16_t* wire, float* new_residual,
                                                       int64_t len) {
  CastPortable<kHalf, kFeedback>(grad, residual, wire, new_residual, len);
}

template <bool kHalf>
__attribute__((target("avx2"))) bool WidenPortableAvx2(const uint16_t* wire, float scale,
                                                        float* out, int64_t len) {
  return WidenPortable<kHalf>(wire, scale, out, len);
}

// float16 through F16C, 8 entries at a time.
// stream: new_residual is 32-byte aligned and written past the caches.
template <bool kFeedback>
__attribute__((target("avx,f16c"))) void CastHalfF16c(const float* grad, const float* residual,
                                                        uint16_t* wire, float* new_residual,
                                                        int64_t len, bool stream) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 smallest_normal = _mm256_set1_ps(0x1p-126f);
  const __m256 rounds_to_inf = _mm256_set1_ps(65520.0f);
  const __m256 inf = _mm256_set1_ps(__builtin_inff());
  const __m256 largest = _mm256_set1_ps(65504.0f);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 v = _mm256_loadu_ps(grad + i);
    if constexpr (kFeedback) {
      v = _mm256_add_ps(v, _mm256_loadu_ps(residual + i));
    } else {  // flush denormals (keeping the sign)
      const __m256 tiny = _mm256_cmp_ps(_mm256_and_ps(v, magnitude), smallest_normal, _CMP_LT_OQ);
      v = _mm256_blendv_ps(v, _mm256_andnot_ps(magnitude, v), tiny);
    }
    const __m256 a = _mm256_and_ps(v, magnitude);
    const __m256 saturate = _mm256_and_ps(_mm256_cmp_ps(a, rounds_to_inf, _CMP_GE_OQ),
                                          _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
    const __m256 clipped = _mm256_or_ps(_mm256_andnot_ps(magnitude, v), largest);
    const __m128i h = _mm256_cvtps_ph(_mm256_blendv_ps(v, clipped, saturate),
                                      _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wire + i), h);
    if constexpr (kFeedback) {
      const __m256 error = _mm256_sub_ps(v, _mm256_cvtph_ps(h));
      if (stream) {
        _mm256_stream_ps(new_residual + i, error);
      } else {
        _mm256_storeu_ps(new_residual + i, error);
      }
    }
  }
  if (stream) _mm_sfence();
  CastPortable<true, kFeedback>(grad + i, kFeedback ? residual + i : nullptr, wire + i,
                                kFeedback ? new_residual + i : nullptr, len - i);
}

// WidenPortable<true> through F16C, 8 entries at a time (stream: out is 32-byte aligned and
// written past the caches).
__attribute__((target("avx,f16c"))) inline bool WidenHalfF16c(const uint16_t* wire, float scale,
                                                                float* out, int64_t len,
                                                                bool stream) {
  const __m256 factor = _mm256_set1_ps(scale);
  const __m128i exponent = _mm_set1_epi16(0x7C00);
  __m128i special = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wire + i));
    const __m256 product = _mm256_mul_ps(_mm256_cvtph_ps(h), factor);
    if (stream) {
      _mm256_stream_ps(out + i, product);
    } else {
      _mm256_storeu_ps(out + i, product);
    }
    special = _mm_or_si128(special, _mm_cmpeq_epi16(_mm_and_si128(h, exponent), exponent));
  }
  if (stream) _mm_sfence();
  const bool tail_finite = WidenPortable<true>(wire + i, scale, out + i, len - i);
  return _mm_testz_si128(special, special) && tail_finite;
}

// bfloat16 through AVX512-BF16, 16 entries at a time.
template <bool kFeedback>
// stream: new_residual is 64-byte aligned and written past the caches.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void CastBf16Avx512(
    const float* grad, const float* residual, uint16_t* wire, float* new_residual, int64_t len,
    bool stream) {
  const __m512 rounds_to_inf = _mm512_set1_ps(FloatOf(0x7F7F8000u));
  const __m512 inf = _mm512_set1_ps(__builtin_inff());
  const __m512i largest = _mm512_set1_epi32(0x7F7F0000);
  const __m512i sign_bit = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i quiet_nan = _mm256_set1_epi16(0x7FC0);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m512 v = _mm512_loadu_ps(grad + i);
    if constexpr (kFeedback) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + i));
    // the conversion reads denormals as zero (keeping the sign), whatever MXCSR says
    const __m512 a = _mm512_abs_ps(v);
    const __mmask16 saturate = _mm512_cmp_ps_mask(a, rounds_to_inf, _CMP_GE_OQ) &
                               _mm512_cmp_ps_mask(a, inf, _CMP_LT_OQ);
    const __m512 clipped = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), sign_bit), largest));
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mask_blend_ps(saturate, v, clipped));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m256i h = _mm256_mask_blend_epi16(nan, reinterpret_cast<const __m256i&>(rounded),
                                              quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(wire + i), h);
    if constexpr (kFeedback) {
      const __m512 sent = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      const __m512 error = _mm512_sub_ps(v, sent);
      if (stream) {
        _mm512_stream_ps(new_residual + i, error);
      } else {
        _mm512_storeu_ps(new_residual + i, error);
      }
    }
  }
  if (stream) _mm_sfence();
  CastPortable<false, kFeedback>(grad + i, kFeedback ? residual + i : nullptr, wire + i,
                                 kFeedback ? new_residual + i : nullptr, len - i);
}
#endif

// [0, len) on the fastest path this CPU has; `portable`: the portable code (compiled for AVX2
// where the CPU has it).
template <bool kHalf, bool kFeedback>
void CastRange(const float* grad, const float* residual, uint16_t* wire, float* new_residual,
               int64_t len, bool portable, bool stream) {
#if defined(__x86_64__)
  if (!portable && kHalf && HasF16c()) {
    CastHalfF16c<kFeedback>(grad, residual, wire, new_residual, len, stream);
    return;
  }
  if (!portable && !kHalf && HasAvx512Bf16()) {
    CastBf16Avx512<kFeedback>(grad, residual, wire, new_residual, len, stream);
    return;
  }
  if (HasAvx2()) {
    CastPortableAvx2<kHalf, kFeedback>(grad, residual, wire, new_residual, len);
    return;
  }
#endif
  CastPortable<kHalf, kFeedback>(grad, residual, wire, new_residual, len);
}

// WidenPortable on the fastest path this CPU has (the portable one when `portable`).
template <bool kHalf>
bool WidenRange(const uint16_t* wire, float scale, float* out, int64_t len, bool portable,
                bool stream) {
#if defined(__x86_64__)
  if (!portable && kHalf && HasF16c()) return WidenHalfF16c(wire, scale, out, len, stream);
  if (HasAvx2()) return WidenPortableAvx2<kHalf>(wire, scale, out, len);
#endif
  return WidenPortable<kHalf>(wire, scale, out, len);
}

// -- WireSum -------------------------------------------------------------------------------
// Sums of the rows of [ranks, n] wire bits (row p at rows + p * stride) as TensorFlow's
// reduce_sum of the rows widened to float32 gives them: from +0.0, in rank order, under
// DAZ/FTZ; then rounded once to nearest even, beyond the range to Inf (as Cast), NaN as
// kQuietNan. One row is returned as it is, denormals included, NaNs as kQuietNan (reduce_sum
// skips a reduction over one entry).

// The NaN of every sum (TensorFlow's vectorized Cast to bfloat16 gives 0x7FC0; its scalar
// code keeps the sign, and which NaN an addition keeps depends on the operand order).
template <bool kHalf>
constexpr uint32_t kQuietNan = kHalf ? 0x7E00u : 0x7FC0u;

template <bool kHalf>
inline float WireValue(uint32_t h) {
  return kHalf ? HalfValue(h) : Bf16Value(h);
}

// The wire bits of the float32 sum of bits u.
template <bool kHalf>
inline uint16_t SumBits(uint32_t u) {
  if constexpr (!kHalf) return Bf16Bits<false>(u);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(Pick(nan, kQuietNan<true>, HalfBits<false>(u)));
}

// out[0:len] = the only row (ranks == 1), NaNs as kQuietNan.
template <bool kHalf>
void CopyRow(const uint16_t* __restrict__ row, uint16_t* __restrict__ out, int64_t len) {
  const uint32_t inf = kHalf ? 0x7C00u : 0x7F80u;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t h = row[i];
    out[i] = static_cast<uint16_t>(Pick((h & 0x7FFFu) > inf, kQuietNan<kHalf>, h));
  }
}

// out[0:len] = the sums of rows[p * stride + (0:len)] over p < ranks (the portable path:
// blocks of entries accumulated row after row, so that the inner loops vectorize).
template <bool kHalf>
__attribute__((always_inline)) inline void SumPortable(const uint16_t* __restrict__ rows,
                                                       int64_t stride, int64_t ranks,
                                                       uint16_t* __restrict__ out, int64_t len) {
  constexpr int64_t kBlock = 512;
  float acc[kBlock];
  for (int64_t b = 0; b < len; b += kBlock) {
    const int64_t m = std::min(kBlock, len - b);
    for (int64_t j = 0; j < m; ++j) acc[j] = 0.0f;
    for (int64_t p = 0; p < ranks; ++p) {
      const uint16_t* row = rows + p * stride + b;
      for (int64_t j = 0; j < m; ++j) acc[j] += WireValue<kHalf>(row[j]);
    }
    for (int64_t j = 0; j < m; ++j) out[b + j] = SumBits<kHalf>(BitsOf(acc[j]));
  }
}

#if defined(__x86_64__)
template <bool kHalf>
__attribute__((target("avx2"))) void SumPortableAvx2(const uint16_t* rows, int64_t stride,
                                                      int64_t ranks, uint16_t* out, int64_t len) {
  SumPortable<kHalf>(rows, stride, ranks, out, len);
}

// float16 sums through F16C, 8 entries at a time.
// stream: out is 16-byte aligned and written past the caches.
__attribute__((target("avx,f16c"))) void SumHalfF16c(const uint16_t* rows, int64_t stride,
                                                       int64_t ranks, uint16_t* out, int64_t len,
                                                       bool stream) {
  const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));  // to 0x7E00
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t p = 0; p < ranks; ++p) {
      const auto* h = reinterpret_cast<const __m128i*>(rows + p * stride + i);
      acc = _mm256_add_ps(acc, _mm256_cvtph_ps(_mm_loadu_si128(h)));
    }
    acc = _mm256_blendv_ps(acc, quiet_nan, _mm256_cmp_ps(acc, acc, _CMP_UNORD_Q));
    const __m128i h = _mm256_cvtps_ph(acc, _MM_FROUND_TO_NEAREST_INT);
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out + i), h);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    }
  }
  if (stream) _mm_sfence();
  SumPortable<true>(rows + i, stride, ranks, out + i, len - i);
}

// bfloat16 sums through AVX512-BF16, 16 entries at a time (the sums are never denormal: FTZ).
// stream: out is 32-byte aligned and written past the caches.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void SumBf16Avx512(
    const uint16_t* rows, int64_t stride, int64_t ranks, uint16_t* out, int64_t len,
    bool stream) {
  const __m256i quiet_nan = _mm256_set1_epi16(kQuietNan<false>);
  int64_t i = 0;
  for (; i + 16 <= len; i += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < ranks; ++p) {
      const auto* h = reinterpret_cast<const __m256i*>(rows + p * stride + i);
      const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(h)), 16);
      acc = _mm512_add_ps(acc, _mm512_castsi512_ps(widened));
    }
    const __m256bh rounded = _mm512_cvtneps_pbh(acc);
    const __mmask16 nan = _mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q);
    const __m256i h =
        _mm256_mask_blend_epi16(nan, reinterpret_cast<const __m256i&>(rounded), quiet_nan);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), h);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
    }
  }
  if (stream) _mm_sfence();
  SumPortable<false>(rows + i, stride, ranks, out + i, len - i);
}
#endif

// The sums of [0, len) on the fastest path this CPU has (`portable` as for CastRange).
template <bool kHalf>
void SumRange(const uint16_t* rows, int64_t stride, int64_t ranks, uint16_t* out, int64_t len,
              bool portable, bool stream) {
  if (ranks == 1) {
    CopyRow<kHalf>(rows, out, len);
    return;
  }
#if defined(__x86_64__)
  if (!portable && kHalf && HasF16c()) {
    SumHalfF16c(rows, stride, ranks, out, len, stream);
    return;
  }
  if (!portable && !kHalf && HasAvx512Bf16()) {
    SumBf16Avx512(rows, stride, ranks, out, len, stream);
    return;
  }
  if (HasAvx2()) {
    SumPortableAvx2<kHalf>(rows, stride, ranks, out, len);
    return;
  }
#endif
  SumPortable<kHalf>(rows, stride, ranks, out, len);
}

// -- The kernels ---------------------------------------------------------------------------

// What every kernel here reads from its attrs: the wire type and `portable`.
class WireKernel : public OpKernel {
 public:
  explicit WireKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    DataType wire_type;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire_type", &wire_type));
    half_ = wire_type == DT_HALF;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("portable", &portable_));
  }

 protected:
  bool half_ = true;  // float16 wire, else bfloat16
  bool portable_ = false;
};

class SaturatingCastFeedbackCpuOp : public WireKernel {
 public:
  using WireKernel::WireKernel;

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& grad = ctx->input(0);
    OpInputList residuals;
    OP_REQUIRES_OK(ctx, ctx->input_list("residual", &residuals));
    OP_REQUIRES(ctx, residuals.size() <= 1,
                absl::InvalidArgumentError(absl::StrCat(
                    "SaturatingCastFeedback: at most one residual, got ", residuals.size())));
    const bool feedback = residuals.size() == 1;
    if (feedback) {
      OP_REQUIRES(ctx, residuals[0].shape() == grad.shape(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "SaturatingCastFeedback: residual must have grad's shape ",
                      grad.shape().DebugString(), ", got ", residuals[0].shape().DebugString())));
    }
    Tensor* wire_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, grad.shape(), &wire_t));
    Tensor* new_residual_t = nullptr;
    if (feedback) {
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({1}, 1, grad.shape(),
                                                                &new_residual_t));
    }
    const int64_t n = grad.NumElements();
    const float* g = grad.flat<float>().data();
    const float* e = feedback ? residuals[0].flat<float>().data() : nullptr;
    auto* w = static_cast<uint16_t*>(wire_t->data());
    float* out = feedback ? new_residual_t->flat<float>().data() : nullptr;
    const AlignedChunks chunks{n, std::clamp<int64_t>(n / kMinChunk, 1, WorkerThreads(ctx))};
    const bool stream = feedback && Streamed(out, n);
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      const int64_t b = chunks.Begin(c);
      const int64_t len = chunks.End(c) - b;
      const float* eb = feedback ? e + b : nullptr;
      float* ob = feedback ? out + b : nullptr;
      const bool p = portable_;
      if (half_ && feedback) CastRange<true, true>(g + b, eb, w + b, ob, len, p, stream);
      if (half_ && !feedback) CastRange<true, false>(g + b, eb, w + b, ob, len, p, stream);
      if (!half_ && feedback) CastRange<false, true>(g + b, eb, w + b, ob, len, p, stream);
      if (!half_ && !feedback) CastRange<false, false>(g + b, eb, w + b, ob, len, p, stream);
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("SaturatingCastFeedback").Device(DEVICE_CPU),
                        SaturatingCastFeedbackCpuOp);

class WireToFloatCpuOp : public WireKernel {
 public:
  using WireKernel::WireKernel;

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& wire = ctx->input(0);
    const Tensor& scale_t = ctx->input(1);
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(scale_t.shape()),
                absl::InvalidArgumentError(absl::StrCat("WireToFloat: scale must be a scalar, got ",
                                                        scale_t.shape().DebugString())));
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, wire.shape(), &out_t));
    Tensor* finite_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &finite_t));
    const int64_t n = wire.NumElements();
    const auto* w = static_cast<const uint16_t*>(wire.data());
    float* out = out_t->flat<float>().data();
    const float scale = scale_t.scalar<float>()();
    const AlignedChunks chunks{n, std::clamp<int64_t>(n / kMinChunk, 1, WorkerThreads(ctx))};
    const bool stream = Streamed(out, n);
    std::vector<char> finite(chunks.count, 1);
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      const int64_t b = chunks.Begin(c);
      const int64_t len = chunks.End(c) - b;
      finite[c] = half_ ? WidenRange<true>(w + b, scale, out + b, len, portable_, stream)
                        : WidenRange<false>(w + b, scale, out + b, len, portable_, stream);
    });
    finite_t->scalar<bool>()() =
        std::all_of(finite.begin(), finite.end(), [](char f) { return f != 0; });
  }
};

REGISTER_KERNEL_BUILDER(Name("WireToFloat").Device(DEVICE_CPU), WireToFloatCpuOp);

class WireSumCpuOp : public WireKernel {
 public:
  using WireKernel::WireKernel;

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& gathered = ctx->input(0);
    OP_REQUIRES(ctx, gathered.dims() >= 1,
                absl::InvalidArgumentError(
                    "WireSum: gathered must have rank >= 1 (ranks first), got a scalar"));
    TensorShape shape = gathered.shape();
    const int64_t ranks = shape.dim_size(0);
    shape.RemoveDim(0);
    Tensor* sum_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &sum_t));
    const int64_t n = shape.num_elements();
    const auto* rows = static_cast<const uint16_t*>(gathered.data());
    auto* sum = static_cast<uint16_t*>(sum_t->data());
    const int64_t work = n * std::max<int64_t>(ranks, 1);
    const AlignedChunks chunks{n, std::clamp<int64_t>(work / kMinChunk, 1, WorkerThreads(ctx))};
    const bool stream = Streamed(sum, n);
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      const int64_t b = chunks.Begin(c);
      const int64_t len = chunks.End(c) - b;
      if (half_) SumRange<true>(rows + b, n, ranks, sum + b, len, portable_, stream);
      if (!half_) SumRange<false>(rows + b, n, ranks, sum + b, len, portable_, stream);
    });
  }
};

REGISTER_KERNEL_BUILDER(Name("WireSum").Device(DEVICE_CPU), WireSumCpuOp);

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
