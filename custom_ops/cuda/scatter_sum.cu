// CUDA core of ScatterSum, free of TensorFlow.
//
// dense is zeroed with cudaMemsetAsync, then a grid-stride kernel adds every value at its index
// with atomicAdd (float16 natively from sm_70, the oldest architecture built; bfloat16 natively
// from sm_80, by a compare-and-swap loop on the 16-bit word below). Indices outside [0, n) are
// skipped: a kernel cannot fail the op without a host synchronization (the CPU kernel rejects
// them). The denormal policy (tfs_common.h) is applied explicitly: values are read with
// denormals as zero, and for float32, float64 and bfloat16 a second pass flushes denormal sums
// to signed zero. A sum of two values is commutative and a denormal sum of two normal numbers
// is exact, so an index with at most two values gets the CPU kernel's bits; with three or more,
// the order of the atomic additions varies from run to run, and so may the last bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "launch.cuh"
#include "tfs_common.h"
#include "tfs_cuda.h"

namespace tfs {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void AtomicAddTo(__half* slot, __half v) { atomicAdd(slot, v); }

__device__ __forceinline__ void AtomicAddTo(__nv_bfloat16* slot, __nv_bfloat16 v) {
#if __CUDA_ARCH__ >= 800
  atomicAdd(slot, v);
#else
  // bfloat16 + bfloat16 rounded once from float32, as the native instruction does.
  unsigned short* bits = reinterpret_cast<unsigned short*>(slot);
  unsigned short old = *bits;
  unsigned short seen;
  do {
    seen = old;
    const float sum = __bfloat162float(__ushort_as_bfloat16(seen)) + __bfloat162float(v);
    old = atomicCAS(bits, seen, __bfloat16_as_ushort(__float2bfloat16_rn(sum)));
  } while (old != seen);
#endif
}

__device__ __forceinline__ void AtomicAddTo(float* slot, float v) { atomicAdd(slot, v); }
__device__ __forceinline__ void AtomicAddTo(double* slot, double v) { atomicAdd(slot, v); }

// Denormals to signed zeros (NaN payloads kept); float16 keeps them (computed in float32).
__device__ __forceinline__ __half Flush(__half v) { return v; }
__device__ __forceinline__ __nv_bfloat16 Flush(__nv_bfloat16 v) {
  const unsigned short bits = __bfloat16_as_ushort(v);
  return (bits & 0x7F80u) == 0 ? __ushort_as_bfloat16(bits & 0x8000u) : v;
}
__device__ __forceinline__ float Flush(float v) { return FlushDenormal(v); }
__device__ __forceinline__ double Flush(double v) { return FlushDenormal(v); }

template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    ScatterKernel(const T* __restrict__ values, const Index* __restrict__ indices, int64_t m,
                  int64_t n, T* dense) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m;
       i += stride) {
    const int64_t j = static_cast<int64_t>(indices[i]);
    if (j >= 0 && j < n) AtomicAddTo(dense + j, Flush(values[i]));
  }
}

// Flushes the denormal sums: every slot written is rewritten once per value added to it, each
// time with the same bits.
template <typename T, typename Index>
__global__ void __launch_bounds__(kThreads)
    FlushKernel(const Index* __restrict__ indices, int64_t m, int64_t n, T* dense) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m;
       i += stride) {
    const int64_t j = static_cast<int64_t>(indices[i]);
    if (j >= 0 && j < n) dense[j] = Flush(dense[j]);
  }
}

template <typename T, typename Index>
int Scatter(const void* values, const void* indices, int64_t m, int64_t n, void* dense,
            cudaStream_t stream) {
  const cudaError_t err = cudaMemsetAsync(dense, 0, static_cast<size_t>(n) * sizeof(T), stream);
  if (err != cudaSuccess || m == 0) return static_cast<int>(err);
  const Index* idx = static_cast<const Index*>(indices);
  T* out = static_cast<T*>(dense);
  ScatterKernel<T, Index><<<GridFor(ScatterKernel<T, Index>, kThreads, m), kThreads, 0, stream>>>(
      static_cast<const T*>(values), idx, m, n, out);
  if constexpr (!std::is_same_v<T, __half>) {
    FlushKernel<T, Index><<<GridFor(FlushKernel<T, Index>, kThreads, m), kThreads, 0, stream>>>(
        idx, m, n, out);
  }
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int ScatterAs(const void* values, const void* indices, int index_bytes, int64_t m, int64_t n,
              void* dense, cudaStream_t stream) {
  return index_bytes == 4 ? Scatter<T, int32_t>(values, indices, m, n, dense, stream)
                          : Scatter<T, int64_t>(values, indices, m, n, dense, stream);
}

}  // namespace
}  // namespace tfs

extern "C" int tfs_scatter_sum(int dtype, const void* values, const void* indices,
                               int index_bytes, int64_t m, int64_t n, void* dense,
                               cudaStream_t stream) {
  using namespace tfs;
  if (dtype < TFS_F16 || dtype > TFS_F64 || (index_bytes != 4 && index_bytes != 8) || m < 0 ||
      n < 0) {
    return TFS_ERR_ARG;
  }
  if (n == 0) return TFS_OK;
  switch (dtype) {
    case TFS_F16:
      return ScatterAs<__half>(values, indices, index_bytes, m, n, dense, stream);
    case TFS_BF16:
      return ScatterAs<__nv_bfloat16>(values, indices, index_bytes, m, n, dense, stream);
    case TFS_F32:
      return ScatterAs<float>(values, indices, index_bytes, m, n, dense, stream);
    default:
      return ScatterAs<double>(values, indices, index_bytes, m, n, dense, stream);
  }
}
