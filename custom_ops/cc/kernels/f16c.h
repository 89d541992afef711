// float16 conversions through F16C where the CPU has it (chosen at run time: the build targets
// x86-64-v2, which lacks it, and Eigen's software conversion costs ~10x a memory pass), and the
// run-time check for AVX512-BF16.
// Round to nearest even, like Eigen; a NaN keeps its sign and top payload bits, quieted.
#ifndef TFS_KERNELS_F16C_H_
#define TFS_KERNELS_F16C_H_

#include <cstdint>
#include <cstring>

#include "tensorflow/core/framework/numeric_types.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace tensorflow {
namespace tfs_ops {

#if defined(__x86_64__)
inline bool HasF16c() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  }();
  return has;
}

// Whether the CPU (and OS) has AVX512-BF16 with AVX512BW/VL (float32 to bfloat16 by
// VCVTNEPS2BF16).
inline bool HasAvx512Bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return has;
}

// out[0:len] = float16(in[0:len]); only when HasF16c().
__attribute__((target("avx,f16c"))) inline void FloatsToHalfF16c(const float* in, int64_t len,
                                                                   Eigen::half* out) {
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + j), _MM_FROUND_TO_NEAREST_INT));
  }
  if (j == len) return;
  float tail[8] = {};
  std::memcpy(tail, in + j, (len - j) * sizeof(float));
  uint16_t halves[8];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(halves),
                   _mm256_cvtps_ph(_mm256_loadu_ps(tail), _MM_FROUND_TO_NEAREST_INT));
  std::memcpy(static_cast<void*>(out + j), halves, (len - j) * sizeof(uint16_t));
}
#endif

}  // namespace tfs_ops
}  // namespace tensorflow

#endif  // TFS_KERNELS_F16C_H_
