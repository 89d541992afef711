// Shared, TensorFlow-free definitions of the op semantics, used by the CPU kernels and the
// CUDA core alike so both compute bit-identical results.
#ifndef TFS_COMMON_H_
#define TFS_COMMON_H_

#include <cfloat>
#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define TFS_HD __host__ __device__ __forceinline__
#else
#define TFS_HD inline
#endif

namespace tfs {

// Width of one radix digit in the selection passes.
constexpr int kDigitBits = 11;
// Largest supported QSGD level count (the payload must fit int16).
constexpr int kMaxLevels = 32767;

// Magnitude keys: the IEEE bit pattern with the sign bit cleared, monotone in |x|, NaN above
// +Inf, +0.0 == -0.0. key_bits is the number of significant bits (15, 31 or 63).
template <int Bytes>
struct KeyOf;
template <>
struct KeyOf<2> {
  using Bits = uint16_t;
  static constexpr int kBits = 15;
  static TFS_HD Bits Key(Bits b) { return static_cast<Bits>(b & 0x7FFFu); }
};
template <>
struct KeyOf<4> {
  using Bits = uint32_t;
  static constexpr int kBits = 31;
  static TFS_HD Bits Key(Bits b) { return b & 0x7FFFFFFFu; }
};
template <>
struct KeyOf<8> {
  using Bits = uint64_t;
  static constexpr int kBits = 63;
  static TFS_HD Bits Key(Bits b) { return b & 0x7FFFFFFFFFFFFFFFull; }
};

// MurmurHash3's 32-bit finalizer.
TFS_HD uint32_t Fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// Counter-based uniform in [0, 1): (fmix32(fmix32(i ^ key0) ^ key1) >> 8) * 2^-24, where
// key0/key1 are the low/high 32 bits of the seed and i is the flat index modulo 2^32.
TFS_HD float HashUniform(int64_t seed, int64_t index) {
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t key0 = static_cast<uint32_t>(s);
  const uint32_t key1 = static_cast<uint32_t>(s >> 32);
  const uint32_t h = Fmix32(Fmix32(static_cast<uint32_t>(index) ^ key0) ^ key1);
  // h >> 8 < 2^24 converts exactly; going through int32 lets the conversion vectorize.
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * 5.9604644775390625e-08f;  // 2^-24
}

// QSGD geometry: buckets of min(bucket_size, n) entries, one bucket of the whole tensor when
// bucket_size is 0 (at least 1 entry). Clamping changes no result: a bucket's zero padding
// adds +0.0 to its sum of squares. bucket_size < 0 is rejected by the callers.
TFS_HD int64_t EffectiveBucket(int64_t n, int64_t bucket_size) {
  const int64_t whole = n > 1 ? n : 1;
  return bucket_size > 0 && bucket_size < whole ? bucket_size : whole;
}
TFS_HD int64_t NumBuckets(int64_t n, int64_t bucket_size) {
  const int64_t b = EffectiveBucket(n, bucket_size);
  return n <= 0 ? 0 : n / b + (n % b != 0);
}
// Elias-Fano index code of k of n indices with low parts of low_bits bits: bits of its map
// (bits [0, map) hold a one per index), and its bytes (the k low parts follow the map).
TFS_HD int64_t IndexCodeMapBits(int64_t n, int64_t k, int64_t low_bits) {
  return k == 0 ? 0 : ((n - 1) >> low_bits) + k;
}
TFS_HD int64_t IndexCodeBytes(int64_t n, int64_t k, int64_t low_bits) {
  return (IndexCodeMapBits(n, k, low_bits) + k * low_bits + 7) / 8;
}
// Smallest power of two >= x, for 1 <= x <= 2^62 (x is a bucket length, at most n).
TFS_HD int64_t Pow2Ceil(int64_t x) {
  int64_t p = 1;
  while (p < x && p < (int64_t{1} << 62)) p <<= 1;
  return p;
}
// Powers of two as shifts (bucket geometry without 64-bit division on the GPU).
TFS_HD int Log2(int64_t pow2) {
  int s = 0;
  while ((int64_t{1} << s) < pow2) ++s;
  return s;
}

// Correctly rounded float arithmetic that the CUDA compiler may not contract into FMAs (the host
// build uses -ffp-contract=off).
#if defined(__CUDA_ARCH__)
#define TFS_FADD(a, b) __fadd_rn(a, b)
#define TFS_FSUB(a, b) __fsub_rn(a, b)
#define TFS_FMUL(a, b) __fmul_rn(a, b)
#define TFS_FDIV(a, b) __fdiv_rn(a, b)
#else
#define TFS_FADD(a, b) ((a) + (b))
#define TFS_FSUB(a, b) ((a) - (b))
#define TFS_FMUL(a, b) ((a) * (b))
#define TFS_FDIV(a, b) ((a) / (b))
#endif

// Denormal policy (TensorFlow's CPU, x86 DAZ + FTZ): float32/float64 arithmetic reads denormal
// operands as zero and returns zero (sign kept) for a result that, rounded to the type's
// precision with an unbounded exponent, is below the smallest normal. The CPU kernels get this
// from the FPU (they run under tsl::port::ScopedFlushDenormal); the CUDA core computes with
// denormals (IEEE) and applies the rule with the functions below.
constexpr double kF32FlushBelow = static_cast<double>(FLT_MIN) * (1.0 - 0x1p-25);

TFS_HD float FlushDenormal(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }
TFS_HD double FlushDenormal(double x) { return fabs(x) < DBL_MIN ? copysign(0.0, x) : x; }

// a / b for normal or zero a and b > 0, flushed by the rule: a result of exactly FLT_MIN is
// flushed when the exact quotient is below kF32FlushBelow (b * kF32FlushBelow is exact in
// float64: 24 + 25 significant bits).
TFS_HD float DivideFtz(float a, float b) {
  const float q = TFS_FDIV(a, b);
  const float m = fabsf(q);
  const bool small =
      m < FLT_MIN || (m == FLT_MIN && fabs(static_cast<double>(a)) <
                                          static_cast<double>(b) * kF32FlushBelow);
  return small ? copysignf(0.0f, q) : q;
}

#if defined(__CUDA_ARCH__)
#define TFS_DAZ(x) ::tfs::FlushDenormal(x)
#define TFS_FDIV_FTZ(a, b) ::tfs::DivideFtz(a, b)
#else
#define TFS_DAZ(x) (x)
#define TFS_FDIV_FTZ(a, b) ((a) / (b))
#endif

// QSGD's float32 view of an input: denormals flushed, finite values beyond float32's range
// saturated to +-FLT_MAX, float64 rounded by the flush rule. float16 values convert exactly.
TFS_HD float QsgdInput(float x) { return FlushDenormal(x); }
TFS_HD float QsgdInput(double x) {
  constexpr double kMax = FLT_MAX;
  const double clamped = x > kMax ? kMax : (x < -kMax ? -kMax : x);
  const double clipped = fabs(x) <= DBL_MAX ? clamped : x;
  const float f = static_cast<float>(clipped);
  return fabs(x) < kF32FlushBelow ? copysignf(0.0f, f) : f;
}

// A bucket norm from its float64 sum of squares: finite norms above FLT_MAX saturate.
TFS_HD float NormFromSumOfSquares(double sum) {
  const double norm = sqrt(sum);
  return static_cast<float>(norm > static_cast<double>(FLT_MAX) && norm <= DBL_MAX
                                ? static_cast<double>(FLT_MAX)
                                : norm);
}

// One QSGD level: r = |x| / norm * levels (norm 1 when it is not > 0), floor(r) rounded up with
// probability frac(r), capped at levels, signed like x; NaN levels (NaN input, Inf / Inf) give 0.
// x is a QsgdInput. Written with selects only, so that loops over it vectorize.
TFS_HD int QuantizeOne(float x, float norm, float levels, float u) {
  const float safe = norm > 0.0f ? norm : 1.0f;
  const float r = TFS_FMUL(TFS_FDIV_FTZ(fabsf(x), safe), levels);
  const float fl = floorf(r);
  const float level = TFS_FADD(fl, (u < TFS_FSUB(r, fl)) ? 1.0f : 0.0f);
  const float capped = level < levels ? level : levels;
  const float finite = level != level ? 0.0f : capped;
  return static_cast<int>(x < 0.0f ? -finite : finite);
}

// Scale of one QSGD bucket in the decoder: norm / levels.
TFS_HD float DequantizeScale(float norm, float levels) {
  return TFS_FDIV_FTZ(TFS_DAZ(norm), levels);
}
// q * scale clamped to +-top, the output type's largest finite magnitude (NaN stays NaN).
TFS_HD float DequantizeOne(int q, float scale, float top) {
  const float v = TFS_FMUL(static_cast<float>(q), scale);
  return v > top ? top : (v < -top ? -top : v);
}
// Largest finite magnitudes of the QSGD output types, as float32 (float64 output is computed
// in float32).
constexpr float kHalfMax = 65504.0f;
constexpr float kBfloat16Max = 0x1.FEp+127f;

}  // namespace tfs

#endif  // TFS_COMMON_H_
