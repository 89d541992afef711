// CUDA core of QSGDQuantize / QSGDDequantize, free of TensorFlow.
//
// Bucket norms use the reference's summation order exactly: the bucket is zero-padded to a
// power of two P and float64 squares are added in a tree of adjacent pairs. Up to 256 threads
// sum an aligned block of min(P, 4096) entries, loaded coalesced into shared memory (a
// register tree per thread, a shuffle butterfly, a tree over the warps: see BlockSumsKernel);
// when P > 4096, the block sums are halved pairwise in further launches. Small blocks share a
// thread block, and all loops are grid-stride with grids from the occupancy API. Bucket
// lengths are not powers of two in general: in quantizing, per-element bucket numbers are
// stepped incrementally (two 64-bit divisions per thread, not per element).
// Inputs go through QsgdInput (denormals flushed, saturation; see tfs_common.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "launch.cuh"
#include "tfs_common.h"
#include "tfs_cuda.h"

namespace tfs {
namespace {

constexpr int64_t kNormBlock = 4096;
constexpr int kNormThreads = 256;
constexpr int kThreads = 256;
constexpr size_t kAlign = 256;

template <int Dtype>
struct Elem;
template <>
struct Elem<TFS_F16> {
  using Type = __half;
  static constexpr float kMax = kHalfMax;
  static __device__ __forceinline__ float ToFloat(Type v) { return __half2float(v); }
  static __device__ __forceinline__ Type FromFloat(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<TFS_BF16> {
  using Type = __nv_bfloat16;
  static constexpr float kMax = kBfloat16Max;
  static __device__ __forceinline__ float ToFloat(Type v) {
    return QsgdInput(__bfloat162float(v));
  }
  static __device__ __forceinline__ Type FromFloat(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<TFS_F32> {
  using Type = float;
  static constexpr float kMax = FLT_MAX;
  static __device__ __forceinline__ float ToFloat(Type v) { return QsgdInput(v); }
  static __device__ __forceinline__ Type FromFloat(float v) { return v; }
};
template <>
struct Elem<TFS_F64> {
  using Type = double;
  static constexpr float kMax = FLT_MAX;
  static __device__ __forceinline__ float ToFloat(Type v) { return QsgdInput(v); }
  static __device__ __forceinline__ Type FromFloat(float v) { return static_cast<double>(v); }
};

// Geometry shared by the workspace query and the launch.
struct Plan {
  int64_t bucket;      // effective bucket length, min(bucket_size, n)
  int64_t buckets;     // number of buckets
  int64_t block;       // entries summed by one unit (power of two)
  int64_t per_bucket;  // units per padded bucket (power of two)
  int log2_block;
  int log2_per_bucket;
  int64_t units;  // buckets * per_bucket
};

Plan MakePlan(int64_t n, int64_t bucket_size) {
  Plan p;
  p.bucket = EffectiveBucket(n, bucket_size);
  p.buckets = NumBuckets(n, bucket_size);
  const int64_t width = Pow2Ceil(p.bucket);
  p.block = width < kNormBlock ? width : kNormBlock;
  p.per_bucket = width / p.block;
  p.log2_block = Log2(p.block);
  p.log2_per_bucket = Log2(p.per_bucket);
  p.units = p.buckets * p.per_bucket;
  return p;
}

size_t RoundUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

size_t SumsBytes(const Plan& p) { return RoundUp(static_cast<size_t>(p.units) * sizeof(double)); }

// One unit per (bucket, aligned block of `block` padded entries), summed by T = block / kL
// threads (kL = min(block, 16) adjacent entries each); kNormThreads / T units per round. The
// round's squares are staged in shared memory from coalesced loads (one padding slot per 16,
// so that neither the writes nor the kL-strided reads conflict), then each thread adds its kL
// entries in a register tree, the T threads' sums go through a shuffle butterfly (xor 1, 2,
// ...: every lane holds the sum of its aligned group, and a + b == b + a bit for bit), and
// when T > 32 one thread adds the T / 32 warp sums in a tree. All three are trees of adjacent
// pairs of aligned groups: the reference's order. Grid-stride over rounds.
template <int Dtype, int kL>
__global__ void __launch_bounds__(kNormThreads)
    BlockSumsKernel(const typename Elem<Dtype>::Type* __restrict__ x, int64_t n, Plan plan,
                    int log2_threads, double* __restrict__ sums) {
  constexpr int kWarps = kNormThreads / 32;
  constexpr int kStage = kNormThreads * kL;
  __shared__ double stage[kStage + kStage / 16];
  __shared__ double warp_sums[kWarps];
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t >> 5;
  const int lane = t & 31;
  const int log2_lanes = log2_threads < 5 ? log2_threads : 5;
  const int lanes = 1 << log2_lanes;
  const int warps = 1 << (log2_threads - log2_lanes);  // per unit
  const int per_round = kNormThreads >> log2_threads;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * per_round; first < plan.units;
       first += static_cast<int64_t>(gridDim.x) * per_round) {
    for (int p = t; p < kStage; p += kNormThreads) {
      const int64_t unit = first + (p >> plan.log2_block);
      double square = 0.0;
      if (unit < plan.units) {
        const int64_t j = unit >> plan.log2_per_bucket;
        const int64_t i = j * plan.bucket +
                          ((unit & (plan.per_bucket - 1)) << plan.log2_block) +
                          (p & (plan.block - 1));
        const int64_t bucket_end = (j + 1) * plan.bucket < n ? (j + 1) * plan.bucket : n;
        if (i < bucket_end) {
          const double d = static_cast<double>(Elem<Dtype>::ToFloat(x[i]));
          square = __dmul_rn(d, d);
        }
      }
      stage[p + (p >> 4)] = square;
    }
    __syncthreads();
    double v[kL];
#pragma unroll
    for (int e = 0; e < kL; ++e) {
      const int p = t * kL + e;
      v[e] = stage[p + (p >> 4)];
    }
#pragma unroll
    for (int step = 1; step < kL; step <<= 1) {
#pragma unroll
      for (int e = 0; e < kL; e += 2 * step) v[e] = __dadd_rn(v[e], v[e + step]);
    }
    for (int m = 1; m < lanes; m <<= 1) {
      v[0] = __dadd_rn(v[0], __shfl_xor_sync(0xFFFFFFFFu, v[0], m));
    }
    const int64_t unit = first + (t >> log2_threads);
    if (warps == 1) {
      if ((lane & (lanes - 1)) == 0 && unit < plan.units) sums[unit] = v[0];
    } else if (lane == 0) {
      warp_sums[warp] = v[0];
    }
    // stage is free and warp_sums complete; the next round writes warp_sums only after its
    // first barrier, which the threads reading it below reach later.
    __syncthreads();
    if (warps > 1 && lane == 0 && (warp & (warps - 1)) == 0 && unit < plan.units) {
      double w[kWarps];
#pragma unroll
      for (int q = 0; q < kWarps; ++q) {
        w[q] = q < warps ? warp_sums[(warp + q) & (kWarps - 1)] : 0.0;
      }
#pragma unroll
      for (int width = kWarps; width > 1; width /= 2) {
        if (width <= warps) {
#pragma unroll
          for (int q = 0; q < width / 2; ++q) w[q] = __dadd_rn(w[2 * q], w[2 * q + 1]);
        }
      }
      sums[unit] = w[0];
    }
  }
}

// width is a power of two, so out[o] adds in[2o] and in[2o + 1] of the same row.
__global__ void HalveKernel(const double* __restrict__ in, double* __restrict__ out,
                            int64_t total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < total;
       o += stride) {
    out[o] = __dadd_rn(in[2 * o], in[2 * o + 1]);
  }
}

__global__ void NormsKernel(const double* __restrict__ sums, int64_t buckets,
                            float* __restrict__ norms) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < buckets;
       j += stride) {
    norms[j] = NormFromSumOfSquares(sums[j]);
  }
}

// Bucket number of a grid-stride loop's index, stepped without dividing per element.
struct BucketCursor {
  int64_t j;
  int64_t offset;
  int64_t dj;
  int64_t doffset;
  int64_t bucket;
  __device__ BucketCursor(int64_t i, int64_t stride, int64_t bucket_len)
      : j(i / bucket_len),
        offset(i - j * bucket_len),
        dj(stride / bucket_len),
        doffset(stride - dj * bucket_len),
        bucket(bucket_len) {}
  __device__ __forceinline__ void Step() {
    j += dj;
    offset += doffset;
    if (offset >= bucket) {
      offset -= bucket;
      ++j;
    }
  }
};

template <int Dtype, typename Q>
__global__ void __launch_bounds__(kThreads)
    QuantizeKernel(const typename Elem<Dtype>::Type* __restrict__ x, int64_t n, int64_t bucket,
                   const float* __restrict__ norms, float levels, int64_t seed,
                   Q* __restrict__ q) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (BucketCursor c(i, stride, bucket); i < n; i += stride, c.Step()) {
    q[i] = static_cast<Q>(
        QuantizeOne(Elem<Dtype>::ToFloat(x[i]), norms[c.j], levels, HashUniform(seed, i)));
  }
}

template <int Dtype, typename Q>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const Q* __restrict__ q, int64_t n, int64_t bucket,
                     const float* __restrict__ norms, float levels,
                     typename Elem<Dtype>::Type* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (BucketCursor c(i, stride, bucket); i < n; i += stride, c.Step()) {
    const float scale = DequantizeScale(norms[c.j], levels);
    out[i] = Elem<Dtype>::FromFloat(
        DequantizeOne(static_cast<int>(q[i]), scale, Elem<Dtype>::kMax));
  }
}

template <int Dtype, int kL>
void LaunchBlockSums(const void* x, int64_t n, const Plan& plan, double* sums,
                     cudaStream_t stream) {
  const int log2_threads = plan.log2_block - Log2(kL);
  const int64_t per_round = kNormThreads >> log2_threads;
  const int grid = GridFor(BlockSumsKernel<Dtype, kL>, kNormThreads,
                           (plan.units + per_round - 1) / per_round * kNormThreads);
  BlockSumsKernel<Dtype, kL><<<grid, kNormThreads, 0, stream>>>(
      static_cast<const typename Elem<Dtype>::Type*>(x), n, plan, log2_threads, sums);
}

template <int Dtype>
int Quantize(const void* x, int64_t n, int levels, int64_t bucket_size, int64_t seed, void* q,
             float* norms, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (n == 0) return TFS_OK;
  const Plan plan = MakePlan(n, bucket_size);
  if (workspace_bytes < 2 * SumsBytes(plan)) return TFS_ERR_ARG;
  double* sums = static_cast<double*>(workspace);
  double* spare = reinterpret_cast<double*>(static_cast<char*>(workspace) + SumsBytes(plan));
  // kL = min(block, 16) entries per thread.
  switch (plan.log2_block < 4 ? plan.log2_block : 4) {
    case 0:
      LaunchBlockSums<Dtype, 1>(x, n, plan, sums, stream);
      break;
    case 1:
      LaunchBlockSums<Dtype, 2>(x, n, plan, sums, stream);
      break;
    case 2:
      LaunchBlockSums<Dtype, 4>(x, n, plan, sums, stream);
      break;
    case 3:
      LaunchBlockSums<Dtype, 8>(x, n, plan, sums, stream);
      break;
    default:
      LaunchBlockSums<Dtype, 16>(x, n, plan, sums, stream);
  }
  for (int64_t width = plan.per_bucket; width > 1; width /= 2) {
    const int64_t total = plan.buckets * width / 2;
    HalveKernel<<<GridFor(HalveKernel, kThreads, total), kThreads, 0, stream>>>(sums, spare,
                                                                               total);
    double* t = sums;
    sums = spare;
    spare = t;
  }
  NormsKernel<<<GridFor(NormsKernel, kThreads, plan.buckets), kThreads, 0, stream>>>(
      sums, plan.buckets, norms);
  using T = typename Elem<Dtype>::Type;
  const float lv = static_cast<float>(levels);
  if (levels <= 127) {
    QuantizeKernel<Dtype, int8_t><<<GridFor(QuantizeKernel<Dtype, int8_t>, kThreads, n),
                                    kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, plan.bucket, norms, lv, seed, static_cast<int8_t*>(q));
  } else {
    QuantizeKernel<Dtype, int16_t><<<GridFor(QuantizeKernel<Dtype, int16_t>, kThreads, n),
                                     kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, plan.bucket, norms, lv, seed, static_cast<int16_t*>(q));
  }
  return static_cast<int>(cudaGetLastError());
}

template <int Dtype>
int Dequantize(const void* q, const float* norms, int64_t n, int levels, int64_t bucket_size,
               void* out, cudaStream_t stream) {
  if (n == 0) return TFS_OK;
  using T = typename Elem<Dtype>::Type;
  const int64_t bucket = EffectiveBucket(n, bucket_size);
  const float lv = static_cast<float>(levels);
  if (levels <= 127) {
    DequantizeKernel<Dtype, int8_t><<<GridFor(DequantizeKernel<Dtype, int8_t>, kThreads, n),
                                      kThreads, 0, stream>>>(
        static_cast<const int8_t*>(q), n, bucket, norms, lv, static_cast<T*>(out));
  } else {
    DequantizeKernel<Dtype, int16_t><<<GridFor(DequantizeKernel<Dtype, int16_t>, kThreads, n),
                                       kThreads, 0, stream>>>(
        static_cast<const int16_t*>(q), n, bucket, norms, lv, static_cast<T*>(out));
  }
  return static_cast<int>(cudaGetLastError());
}

bool ValidQsgdArgs(int dtype, int64_t n, int levels, int64_t bucket_size) {
  return dtype >= TFS_F16 && dtype <= TFS_F64 && n >= 0 && levels >= 1 &&
         levels <= kMaxLevels && bucket_size >= 0;
}

}  // namespace
}  // namespace tfs

extern "C" int tfs_qsgd_workspace_bytes(int64_t n, int64_t bucket_size, size_t* bytes) {
  if (n < 0 || bucket_size < 0 || bytes == nullptr) return TFS_ERR_ARG;
  *bytes = 2 * tfs::SumsBytes(tfs::MakePlan(n, bucket_size));
  return TFS_OK;
}

extern "C" int tfs_qsgd_quantize(int dtype, const void* input, int64_t n, int levels,
                                 int64_t bucket_size, int64_t seed, void* signed_levels,
                                 float* norms, void* workspace, size_t workspace_bytes,
                                 cudaStream_t stream) {
  using namespace tfs;
  if (!ValidQsgdArgs(dtype, n, levels, bucket_size)) return TFS_ERR_ARG;
  switch (dtype) {
    case TFS_F16:
      return Quantize<TFS_F16>(input, n, levels, bucket_size, seed, signed_levels, norms,
                               workspace, workspace_bytes, stream);
    case TFS_BF16:
      return Quantize<TFS_BF16>(input, n, levels, bucket_size, seed, signed_levels, norms,
                                workspace, workspace_bytes, stream);
    case TFS_F32:
      return Quantize<TFS_F32>(input, n, levels, bucket_size, seed, signed_levels, norms,
                               workspace, workspace_bytes, stream);
    default:
      return Quantize<TFS_F64>(input, n, levels, bucket_size, seed, signed_levels, norms,
                               workspace, workspace_bytes, stream);
  }
}

extern "C" int tfs_qsgd_dequantize(int dtype, const void* signed_levels, const float* norms,
                                   int64_t n, int levels, int64_t bucket_size, void* output,
                                   cudaStream_t stream) {
  using namespace tfs;
  if (!ValidQsgdArgs(dtype, n, levels, bucket_size)) return TFS_ERR_ARG;
  switch (dtype) {
    case TFS_F16:
      return Dequantize<TFS_F16>(signed_levels, norms, n, levels, bucket_size, output, stream);
    case TFS_BF16:
      return Dequantize<TFS_BF16>(signed_levels, norms, n, levels, bucket_size, output, stream);
    case TFS_F32:
      return Dequantize<TFS_F32>(signed_levels, norms, n, levels, bucket_size, output, stream);
    default:
      return Dequantize<TFS_F64>(signed_levels, norms, n, levels, bucket_size, output, stream);
  }
}
