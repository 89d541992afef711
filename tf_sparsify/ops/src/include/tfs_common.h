// Shared, TensorFlow-free definitions of the op semantics, used by the CPU kernels and the
// CUDA core alike so both compute bit-identical results.
#ifndef TFS_COMMON_H_
#define TFS_COMMON_H_

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

// QSGD geometry: one bucket of the whole tensor when bucket_size is 0.
TFS_HD int64_t EffectiveBucket(int64_t n, int64_t bucket_size) {
  return bucket_size > 0 ? bucket_size : (n > 1 ? n : 1);
}
TFS_HD int64_t NumBuckets(int64_t n, int64_t bucket_size) {
  const int64_t b = EffectiveBucket(n, bucket_size);
  return n == 0 ? 0 : (n + b - 1) / b;
}
// Smallest power of two >= x (x >= 1).
TFS_HD int64_t Pow2Ceil(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
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

// One QSGD level: r = |x| / norm * levels (norm 1 when it is not > 0), floor(r) rounded up with
// probability frac(r), capped at levels, signed like x; NaN levels (NaN input, Inf / Inf) give 0.
// Written with selects only, so that loops over it vectorize.
TFS_HD int QuantizeOne(float x, float norm, float levels, float u) {
  const float safe = norm > 0.0f ? norm : 1.0f;
  const float r = TFS_FMUL(TFS_FDIV(fabsf(x), safe), levels);
  const float fl = floorf(r);
  const float level = TFS_FADD(fl, (u < TFS_FSUB(r, fl)) ? 1.0f : 0.0f);
  const float capped = level < levels ? level : levels;
  const float finite = level != level ? 0.0f : capped;
  return static_cast<int>(x < 0.0f ? -finite : finite);
}

// Scale of one QSGD bucket in the decoder: norm / levels.
TFS_HD float DequantizeScale(float norm, float levels) { return TFS_FDIV(norm, levels); }
TFS_HD float DequantizeOne(int q, float scale) {
  return TFS_FMUL(static_cast<float>(q), scale);
}

}  // namespace tfs

#endif  // TFS_COMMON_H_
