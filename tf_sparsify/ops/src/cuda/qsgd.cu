// CUDA core of QSGDQuantize / QSGDDequantize, free of TensorFlow.
//
// Bucket norms use the reference's summation order exactly: the bucket is zero-padded to a
// power of two P and float64 squares are added in a tree of adjacent pairs. One thread block
// sums an aligned block of min(P, 4096) entries (each thread a run of L adjacent entries, then
// a shared-memory tree over the threads, both adjacent-pair trees); when P > 4096, the block
// sums are halved pairwise in further launches.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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
  static __device__ __forceinline__ float ToFloat(Type v) { return __half2float(v); }
  static __device__ __forceinline__ Type FromFloat(float v) { return __float2half_rn(v); }
};
template <>
struct Elem<TFS_BF16> {
  using Type = __nv_bfloat16;
  static __device__ __forceinline__ float ToFloat(Type v) { return __bfloat162float(v); }
  static __device__ __forceinline__ Type FromFloat(float v) { return __float2bfloat16_rn(v); }
};
template <>
struct Elem<TFS_F32> {
  using Type = float;
  static __device__ __forceinline__ float ToFloat(Type v) { return v; }
  static __device__ __forceinline__ Type FromFloat(float v) { return v; }
};
template <>
struct Elem<TFS_F64> {
  using Type = double;
  static __device__ __forceinline__ float ToFloat(Type v) { return __double2float_rn(v); }
  static __device__ __forceinline__ Type FromFloat(float v) { return static_cast<double>(v); }
};

// Geometry shared by the workspace query and the launch.
struct Plan {
  int64_t bucket;      // effective bucket length
  int64_t buckets;     // number of buckets
  int64_t block;       // entries summed by one thread block (power of two)
  int64_t per_bucket;  // blocks per padded bucket (power of two)
};

Plan MakePlan(int64_t n, int64_t bucket_size) {
  Plan p;
  p.bucket = EffectiveBucket(n, bucket_size);
  p.buckets = NumBuckets(n, bucket_size);
  const int64_t width = Pow2Ceil(p.bucket);
  p.block = width < kNormBlock ? width : kNormBlock;
  p.per_bucket = width / p.block;
  return p;
}

size_t RoundUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

size_t SumsBytes(const Plan& p) {
  return RoundUp(static_cast<size_t>(p.buckets * p.per_bucket) * sizeof(double));
}

// One block per (bucket, block of `block` padded entries); kL adjacent entries per thread.
template <int Dtype, int kL>
__global__ void __launch_bounds__(kNormThreads)
    BlockSumsKernel(const typename Elem<Dtype>::Type* __restrict__ x, int64_t n, Plan plan,
                    int threads, double* __restrict__ sums) {
  __shared__ double sh[kNormThreads];
  const int64_t unit = blockIdx.x;
  const int64_t j = unit / plan.per_bucket;
  const int64_t start = j * plan.bucket + (unit % plan.per_bucket) * plan.block;
  const int64_t bucket_end = (j + 1) * plan.bucket < n ? (j + 1) * plan.bucket : n;
  double v[kL];
#pragma unroll
  for (int e = 0; e < kL; ++e) {
    const int64_t i = start + static_cast<int64_t>(threadIdx.x) * kL + e;
    if (i < bucket_end) {
      const double d = static_cast<double>(Elem<Dtype>::ToFloat(x[i]));
      v[e] = __dmul_rn(d, d);
    } else {
      v[e] = 0.0;
    }
  }
#pragma unroll
  for (int w = kL / 2; w >= 1; w /= 2) {
#pragma unroll
    for (int e = 0; e < w; ++e) v[e] = __dadd_rn(v[2 * e], v[2 * e + 1]);
  }
  sh[threadIdx.x] = v[0];
  __syncthreads();
  for (int w = threads / 2; w >= 1; w /= 2) {
    double s = 0.0;
    if (threadIdx.x < w) s = __dadd_rn(sh[2 * threadIdx.x], sh[2 * threadIdx.x + 1]);
    __syncthreads();
    if (threadIdx.x < w) sh[threadIdx.x] = s;
    __syncthreads();
  }
  if (threadIdx.x == 0) sums[unit] = sh[0];
}

// out[r * width/2 + t] = in[r * width + 2t] + in[r * width + 2t + 1].
__global__ void HalveKernel(const double* __restrict__ in, double* __restrict__ out,
                            int64_t rows, int64_t width) {
  const int64_t half = width / 2;
  const int64_t total = rows * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t o = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; o < total;
       o += stride) {
    const int64_t r = o / half;
    const int64_t t = o % half;
    out[o] = __dadd_rn(in[r * width + 2 * t], in[r * width + 2 * t + 1]);
  }
}

__global__ void NormsKernel(const double* __restrict__ sums, int64_t buckets,
                            float* __restrict__ norms) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < buckets;
       j += stride) {
    norms[j] = __double2float_rn(__dsqrt_rn(sums[j]));
  }
}

template <int Dtype, typename Q>
__global__ void QuantizeKernel(const typename Elem<Dtype>::Type* __restrict__ x, int64_t n,
                               int64_t bucket, const float* __restrict__ norms, float levels,
                               int64_t seed, Q* __restrict__ q) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    q[i] = static_cast<Q>(QuantizeOne(Elem<Dtype>::ToFloat(x[i]), norms[i / bucket], levels,
                                      HashUniform(seed, i)));
  }
}

template <int Dtype, typename Q>
__global__ void DequantizeKernel(const Q* __restrict__ q, int64_t n, int64_t bucket,
                                 const float* __restrict__ norms, float levels,
                                 typename Elem<Dtype>::Type* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float scale = DequantizeScale(norms[i / bucket], levels);
    out[i] = Elem<Dtype>::FromFloat(DequantizeOne(static_cast<int>(q[i]), scale));
  }
}

int GridFor(int64_t work) {
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks < 65536 ? blocks : 65536));
}

template <int Dtype, int kL>
void LaunchBlockSums(const void* x, int64_t n, const Plan& plan, double* sums,
                     cudaStream_t stream) {
  const int threads = static_cast<int>(plan.block / kL);
  BlockSumsKernel<Dtype, kL>
      <<<static_cast<unsigned>(plan.buckets * plan.per_bucket), threads, 0, stream>>>(
          static_cast<const typename Elem<Dtype>::Type*>(x), n, plan, threads, sums);
}

template <int Dtype>
int Quantize(const void* x, int64_t n, int levels, int64_t bucket_size, int64_t seed, void* q,
             float* norms, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (n == 0) return TFS_OK;
  const Plan plan = MakePlan(n, bucket_size);
  if (workspace_bytes < 2 * SumsBytes(plan)) return TFS_ERR_ARG;
  double* sums = static_cast<double*>(workspace);
  double* spare = reinterpret_cast<double*>(static_cast<char*>(workspace) + SumsBytes(plan));
  // threads = block / L with L the smallest power of two keeping threads <= kNormThreads.
  if (plan.block <= kNormThreads) {
    LaunchBlockSums<Dtype, 1>(x, n, plan, sums, stream);
  } else if (plan.block == 2 * kNormThreads) {
    LaunchBlockSums<Dtype, 2>(x, n, plan, sums, stream);
  } else if (plan.block == 4 * kNormThreads) {
    LaunchBlockSums<Dtype, 4>(x, n, plan, sums, stream);
  } else if (plan.block == 8 * kNormThreads) {
    LaunchBlockSums<Dtype, 8>(x, n, plan, sums, stream);
  } else {
    LaunchBlockSums<Dtype, 16>(x, n, plan, sums, stream);
  }
  for (int64_t width = plan.per_bucket; width > 1; width /= 2) {
    HalveKernel<<<GridFor(plan.buckets * width / 2), kThreads, 0, stream>>>(sums, spare,
                                                                            plan.buckets, width);
    double* t = sums;
    sums = spare;
    spare = t;
  }
  NormsKernel<<<GridFor(plan.buckets), kThreads, 0, stream>>>(sums, plan.buckets, norms);
  using T = typename Elem<Dtype>::Type;
  const float lv = static_cast<float>(levels);
  if (levels <= 127) {
    QuantizeKernel<Dtype, int8_t><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const T*>(x), n, plan.bucket, norms, lv, seed, static_cast<int8_t*>(q));
  } else {
    QuantizeKernel<Dtype, int16_t><<<GridFor(n), kThreads, 0, stream>>>(
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
    DequantizeKernel<Dtype, int8_t><<<GridFor(n), kThreads, 0, stream>>>(
        static_cast<const int8_t*>(q), n, bucket, norms, lv, static_cast<T*>(out));
  } else {
    DequantizeKernel<Dtype, int16_t><<<GridFor(n), kThreads, 0, stream>>>(
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
