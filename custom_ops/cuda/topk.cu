// CUDA core of TopKErrorFeedback, free of TensorFlow.
//
// Everything stays on the device (no host synchronization); a small State struct in the
// workspace carries the selection from one kernel to the next:
//   1. acc = grad + residual is written to new_residual while a 2048-bin histogram of the top
//      key digit is built (shared-memory atomics, flushed once per block).
//   2. A one-block kernel finds the digit holding the k-th largest key; read-only passes
//      histogram the next digit inside that band until the k-th key is exact (3 levels for
//      float32). Levels become no-ops once the band is resolved.
//   3. If several elements share the k-th key and only some are taken, the same radix search
//      runs on their indices (the lowest ones win), restricted to the shrinking index range.
//   4. cub::DeviceSelect::If compacts the selected indices in ascending order; a gather kernel
//      writes values and indices and zeroes the selected entries of new_residual.
// The add follows the ops' denormal policy explicitly (see tfs_common.h): float32, float64 and
// bfloat16 (in float32) operands and sums that are denormal become signed zeros. Histogram
// increments are single shared-memory atomics, one per warp when its keys are all equal (zeros,
// and the runs of consecutive tie indices); grids come from the occupancy API. n < 2^31:
// indices are int internally (cub::DeviceSelect, tie radix).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

#include "launch.cuh"
#include "tfs_common.h"
#include "tfs_cuda.h"

namespace tfs {
namespace {

constexpr int kBins = 1 << kDigitBits;
constexpr int kThreads = 512;
constexpr int kFindThreads = 1024;
constexpr int kIndexBits = 31;
constexpr size_t kAlign = 256;

struct State {
  unsigned long long lo;  // key band [lo, hi]: keys above it are selected
  unsigned long long hi;
  long long need;  // how many band members to select
  long long tie_need;
  long long ilo;  // index band of the ties still being resolved
  long long ihi;
  long long idx_limit;  // band members with index <= idx_limit are selected
  int key_active;
  int tie_active;
};

// NaN results of the add as TensorFlow's CPU kernels produce them (x86 SSE and F16C): a NaN
// operand propagates, quieted (when both are NaN the CPU's choice depends on the code path, so
// the payload is unspecified there); Inf + -Inf gives the default NaN, negative. CUDA's own
// arithmetic returns one canonical NaN, which would rank NaNs differently.
__device__ __forceinline__ float HostNaN(float a, float b, float s) {
  if (s == s) return s;
  if (a != a) return __uint_as_float(__float_as_uint(a) | 0x00400000u);
  if (b != b) return __uint_as_float(__float_as_uint(b) | 0x00400000u);
  return __uint_as_float(0xFFC00000u);
}
__device__ __forceinline__ double HostNaN(double a, double b, double s) {
  if (s == s) return s;
  const unsigned long long quiet = 0x0008000000000000ull;
  if (a != a) return __longlong_as_double(__double_as_longlong(a) | quiet);
  if (b != b) return __longlong_as_double(__double_as_longlong(b) | quiet);
  return __longlong_as_double(static_cast<long long>(0xFFF8000000000000ull));
}
// float16 <-> float32 keeping NaN payloads as F16C does (quiet bit set, low bits truncated).
__device__ __forceinline__ float HalfToFloat(uint16_t h) {
  if ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0) {
    return __uint_as_float((static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7FC00000u |
                           (static_cast<uint32_t>(h & 0x03FFu) << 13));
  }
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ uint16_t FloatToHalf(float f) {
  if (f != f) {
    const uint32_t u = __float_as_uint(f);
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x03FFu));
  }
  return __half_as_ushort(__float2half_rn(f));
}

template <int Dtype>
struct Elem;
template <>
struct Elem<TFS_F16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    const float fa = HalfToFloat(a);
    const float fb = HalfToFloat(b);
    return FloatToHalf(HostNaN(fa, fb, __fadd_rn(fa, fb)));
  }
};
template <>
struct Elem<TFS_BF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    const float fa = FlushDenormal(__uint_as_float(static_cast<uint32_t>(a) << 16));
    const float fb = FlushDenormal(__uint_as_float(static_cast<uint32_t>(b) << 16));
    const float s = HostNaN(fa, fb, FlushDenormal(__fadd_rn(fa, fb)));
    if (s != s) return (__float_as_uint(s) >> 31) ? 0xFFC0u : 0x7FC0u;  // Eigen's bfloat16 NaN
    return __bfloat16_as_ushort(__float2bfloat16_rn(s));
  }
};
template <>
struct Elem<TFS_F32> {
  using Bits = uint32_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    const float fa = FlushDenormal(__uint_as_float(a));
    const float fb = FlushDenormal(__uint_as_float(b));
    return __float_as_uint(HostNaN(fa, fb, FlushDenormal(__fadd_rn(fa, fb))));
  }
};
template <>
struct Elem<TFS_F64> {
  using Bits = uint64_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    const double da = FlushDenormal(__longlong_as_double(static_cast<long long>(a)));
    const double db = FlushDenormal(__longlong_as_double(static_cast<long long>(b)));
    return static_cast<Bits>(__double_as_longlong(HostNaN(da, db, FlushDenormal(__dadd_rn(da, db)))));
  }
};

template <typename Bits>
__device__ __forceinline__ Bits KeyBits(Bits b) {
  return KeyOf<sizeof(Bits)>::Key(b);
}

// 16 bytes of elements, loaded and stored as one vector.
template <typename Bits>
struct alignas(16) Vec {
  static constexpr int kN = 16 / sizeof(Bits);
  Bits v[kN];
};

__device__ __forceinline__ void ClearShared(unsigned* sh) {
  for (int d = threadIdx.x; d < kBins; d += blockDim.x) sh[d] = 0;
  __syncthreads();
}

__device__ __forceinline__ void FlushShared(const unsigned* sh, unsigned* hist) {
  __syncthreads();
  for (int d = threadIdx.x; d < kBins; d += blockDim.x) {
    if (sh[d] != 0) atomicAdd(hist + d, sh[d]);
  }
}

__global__ void InitKernel(State* st, unsigned* hist, long long k, unsigned long long key_max) {
  for (int d = threadIdx.x; d < kBins; d += blockDim.x) hist[d] = 0;
  if (threadIdx.x == 0) {
    st->lo = 0;
    st->hi = key_max;
    st->need = k;
    st->tie_need = 0;
    st->ilo = 0;
    st->ihi = 0;
    st->idx_limit = -1;
    st->key_active = 1;
    st->tie_active = 0;
  }
}

// acc = grad + residual (acc may alias residual); histograms key >> shift unless hist is null.
// Loops are warp-uniform (WarpBase) for the warp-level histogram increments.
template <int Dtype>
__global__ void __launch_bounds__(kThreads)
    AddHistKernel(const typename Elem<Dtype>::Bits* __restrict__ grad,
                  const typename Elem<Dtype>::Bits* residual, typename Elem<Dtype>::Bits* acc,
                  int64_t n, bool vectorized, int shift, unsigned* __restrict__ hist) {
  using Bits = typename Elem<Dtype>::Bits;
  using V = Vec<Bits>;
  __shared__ unsigned sh[kBins];
  const bool with_hist = hist != nullptr;
  if (with_hist) ClearShared(sh);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t lane = threadIdx.x & 31;
  const int64_t nvec = vectorized ? n / V::kN : 0;
  for (int64_t base = WarpBase(); base < nvec; base += stride) {
    const int64_t v = base + lane;
    const bool ok = v < nvec;
    V s;
    if (ok) {
      const V a = reinterpret_cast<const V*>(grad)[v];
      const V b = reinterpret_cast<const V*>(residual)[v];
#pragma unroll
      for (int j = 0; j < V::kN; ++j) s.v[j] = Elem<Dtype>::Add(a.v[j], b.v[j]);
      reinterpret_cast<V*>(acc)[v] = s;
    }
    if (with_hist) {
#pragma unroll
      for (int j = 0; j < V::kN; ++j) WarpHistogramAdd(sh, ok ? KeyBits(s.v[j]) >> shift : 0, ok);
    }
  }
  for (int64_t base = nvec * V::kN + WarpBase(); base < n; base += stride) {
    const int64_t i = base + lane;
    const bool ok = i < n;
    Bits s = 0;
    if (ok) {
      s = Elem<Dtype>::Add(grad[i], residual[i]);
      acc[i] = s;
    }
    if (with_hist) WarpHistogramAdd(sh, KeyBits(s) >> shift, ok);
  }
  if (with_hist) FlushShared(sh, hist);
}

// Histograms digit (key >> shift) & mask of the keys inside the current band.
template <typename Bits>
__global__ void __launch_bounds__(kThreads)
    RefineKeyKernel(const Bits* __restrict__ acc, int64_t n, bool vectorized,
                    const State* __restrict__ st, int shift, unsigned mask,
                    unsigned* __restrict__ hist) {
  using V = Vec<Bits>;
  __shared__ unsigned sh[kBins];
  if (!st->key_active) return;
  const Bits lo = static_cast<Bits>(st->lo);
  const Bits span = static_cast<Bits>(st->hi - st->lo);
  ClearShared(sh);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t lane = threadIdx.x & 31;
  const int64_t nvec = vectorized ? n / V::kN : 0;
  for (int64_t base = WarpBase(); base < nvec; base += stride) {
    const int64_t v = base + lane;
    const bool ok = v < nvec;
    V a{};
    if (ok) a = reinterpret_cast<const V*>(acc)[v];
#pragma unroll
    for (int j = 0; j < V::kN; ++j) {
      const Bits key = KeyBits(a.v[j]);
      const bool in = ok && static_cast<Bits>(key - lo) <= span;
      WarpHistogramAdd(sh, (key >> shift) & mask, in);
    }
  }
  for (int64_t base = nvec * V::kN + WarpBase(); base < n; base += stride) {
    const int64_t i = base + lane;
    const bool ok = i < n;
    const Bits key = ok ? KeyBits(acc[i]) : Bits{0};
    WarpHistogramAdd(sh, (key >> shift) & mask, ok && static_cast<Bits>(key - lo) <= span);
  }
  FlushShared(sh, hist);
}

// Histograms digit (i >> shift) & mask of the indices of the ties inside the index band
// (consecutive ties share a digit, so a warp's ties mostly add with one atomic).
template <typename Bits>
__global__ void __launch_bounds__(kThreads)
    RefineTieKernel(const Bits* __restrict__ acc, int64_t n, const State* __restrict__ st,
                    int shift, unsigned mask, unsigned* __restrict__ hist) {
  __shared__ unsigned sh[kBins];
  if (!st->tie_active) return;
  const Bits kth = static_cast<Bits>(st->lo);
  const int64_t end = st->ihi + 1 < n ? st->ihi + 1 : n;
  ClearShared(sh);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t lane = threadIdx.x & 31;
  for (int64_t base = st->ilo + WarpBase(); base < end; base += stride) {
    const int64_t i = base + lane;
    const bool tie = i < end && KeyBits(acc[i]) == kth;
    WarpHistogramAdd(sh, static_cast<unsigned>((i >> shift) & mask), tie);
  }
  FlushShared(sh, hist);
}

// Finds the digit holding the need-th member (largest keys first, or smallest tie indices
// first when kTie), narrows the band in `st` and clears the histogram for the next level.
template <bool kTie>
__global__ void __launch_bounds__(kFindThreads)
    FindDigitKernel(unsigned* hist, int bins, int shift, State* st) {
  using Scan = cub::BlockScan<long long, kFindThreads>;
  constexpr int kPer = kBins / kFindThreads;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ long long s_before;
  __shared__ long long s_count;
  __shared__ int s_digit;
  if (!(kTie ? st->tie_active : st->key_active)) return;
  const long long need = kTie ? st->tie_need : st->need;
  long long count[kPer];
  long long local = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int p = threadIdx.x * kPer + j;
    const int digit = kTie ? p : bins - 1 - p;
    count[j] = p < bins ? hist[digit] : 0;
    local += count[j];
  }
  long long before = 0;
  Scan(scan_storage).ExclusiveSum(local, before);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int p = threadIdx.x * kPer + j;
    if (p < bins && before < need && need <= before + count[j]) {
      s_digit = kTie ? p : bins - 1 - p;
      s_before = before;
      s_count = count[j];
    }
    before += count[j];
  }
  __syncthreads();
  for (int d = threadIdx.x; d < kBins; d += blockDim.x) hist[d] = 0;
  if (threadIdx.x != 0) return;
  const long long left = need - s_before;
  const unsigned long long width = 1ull << shift;
  if (kTie) {
    st->ilo += static_cast<long long>(s_digit) << shift;
    st->ihi = st->ilo + static_cast<long long>(width) - 1;
    st->tie_need = left;
    if (left == s_count) {
      st->tie_active = 0;
      st->idx_limit = st->ihi;
    }
  } else {
    st->lo += static_cast<unsigned long long>(s_digit) << shift;
    st->hi = st->lo + width - 1;
    st->need = left;
    if (left == s_count) {
      st->key_active = 0;
      st->idx_limit = LLONG_MAX;
    } else if (shift == 0) {
      st->key_active = 0;
      st->tie_active = 1;
      st->tie_need = left;
      st->ilo = 0;
      st->ihi = (1ll << kIndexBits) - 1;
    }
  }
}

template <typename Bits>
struct IsSelected {
  const Bits* acc;
  const State* st;
  __device__ __forceinline__ bool operator()(int i) const {
    const Bits key = KeyBits(acc[i]);
    return key > static_cast<Bits>(__ldg(&st->hi)) ||
           (key >= static_cast<Bits>(__ldg(&st->lo)) &&
            static_cast<long long>(i) <= __ldg(&st->idx_limit));
  }
};

template <typename Bits, typename Index>
__global__ void GatherKernel(Bits* acc, const int* __restrict__ selected, int64_t k,
                             Bits* __restrict__ values, Index* __restrict__ indices) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < k;
       j += stride) {
    const int i = selected[j];
    values[j] = acc[i];
    acc[i] = 0;
    indices[j] = static_cast<Index>(i);
  }
}

size_t RoundUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Workspace: State | histogram | selected count | selected indices | CUB scratch.
struct Layout {
  size_t hist;
  size_t count;
  size_t selected;
  size_t cub;
  size_t cub_bytes;
  size_t total;
};

template <typename Bits>
cudaError_t MakeLayout(int64_t n, int64_t k, Layout* layout) {
  size_t cub_bytes = 0;
  const cudaError_t err = cub::DeviceSelect::If(
      nullptr, cub_bytes, thrust::counting_iterator<int>(0), static_cast<int*>(nullptr),
      static_cast<int*>(nullptr), static_cast<int>(n), IsSelected<Bits>{nullptr, nullptr});
  if (err != cudaSuccess) return err;
  layout->hist = RoundUp(sizeof(State));
  layout->count = layout->hist + RoundUp(kBins * sizeof(unsigned));
  layout->selected = layout->count + kAlign;
  layout->cub = layout->selected + RoundUp(static_cast<size_t>(k) * sizeof(int));
  layout->cub_bytes = cub_bytes;
  layout->total = layout->cub + RoundUp(cub_bytes);
  return cudaSuccess;
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int Dtype>
int WorkspaceBytes(int64_t n, int64_t k, size_t* bytes) {
  Layout layout{};
  const cudaError_t err = MakeLayout<typename Elem<Dtype>::Bits>(n, k, &layout);
  if (err != cudaSuccess) return static_cast<int>(err);
  *bytes = layout.total;
  return TFS_OK;
}

template <int Dtype>
int TopK(const void* grad_p, const void* residual_p, void* acc_p, int64_t n, int64_t k,
         void* values, void* indices, int index_bytes, void* workspace, size_t workspace_bytes,
         cudaStream_t stream) {
  using Bits = typename Elem<Dtype>::Bits;
  constexpr int kKeyBits = KeyOf<sizeof(Bits)>::kBits;
  const Bits* grad = static_cast<const Bits*>(grad_p);
  const Bits* residual = static_cast<const Bits*>(residual_p);
  Bits* acc = static_cast<Bits*>(acc_p);
  const bool vectorized = Aligned16(grad) && Aligned16(residual) && Aligned16(acc);
  if (n == 0) return TFS_OK;
  const int64_t work = n / Vec<Bits>::kN + 1;
  const int grid = GridFor(AddHistKernel<Dtype>, kThreads, work);
  if (k == 0) {
    AddHistKernel<Dtype><<<grid, kThreads, 0, stream>>>(grad, residual, acc, n, vectorized, 0,
                                                        nullptr);
    return static_cast<int>(cudaGetLastError());
  }
  Layout layout{};
  cudaError_t err = MakeLayout<Bits>(n, k, &layout);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (workspace_bytes < layout.total) return TFS_ERR_ARG;
  char* ws = static_cast<char*>(workspace);
  State* st = reinterpret_cast<State*>(ws);
  unsigned* hist = reinterpret_cast<unsigned*>(ws + layout.hist);
  int* count = reinterpret_cast<int*>(ws + layout.count);
  int* selected = reinterpret_cast<int*>(ws + layout.selected);

  InitKernel<<<1, 256, 0, stream>>>(st, hist, k, (1ull << kKeyBits) - 1);
  int shift = kKeyBits - kDigitBits;
  AddHistKernel<Dtype><<<grid, kThreads, 0, stream>>>(grad, residual, acc, n, vectorized, shift,
                                                      hist);
  FindDigitKernel<false><<<1, kFindThreads, 0, stream>>>(hist, kBins, shift, st);
  while (shift > 0) {
    const int next = shift > kDigitBits ? shift - kDigitBits : 0;
    const int bins = 1 << (shift - next);
    RefineKeyKernel<Bits><<<GridFor(RefineKeyKernel<Bits>, kThreads, work), kThreads, 0,
                            stream>>>(acc, n, vectorized, st, next, bins - 1, hist);
    FindDigitKernel<false><<<1, kFindThreads, 0, stream>>>(hist, bins, next, st);
    shift = next;
  }
  for (int bit = kIndexBits; bit > 0;) {
    const int next = bit > kDigitBits ? bit - kDigitBits : 0;
    const int bins = 1 << (bit - next);
    RefineTieKernel<Bits><<<GridFor(RefineTieKernel<Bits>, kThreads, n), kThreads, 0, stream>>>(
        acc, n, st, next, bins - 1, hist);
    FindDigitKernel<true><<<1, kFindThreads, 0, stream>>>(hist, bins, next, st);
    bit = next;
  }
  size_t cub_bytes = layout.cub_bytes;
  err = cub::DeviceSelect::If(ws + layout.cub, cub_bytes, thrust::counting_iterator<int>(0),
                              selected, count, static_cast<int>(n), IsSelected<Bits>{acc, st},
                              stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (index_bytes == 4) {
    GatherKernel<Bits, int32_t><<<GridFor(GatherKernel<Bits, int32_t>, kThreads, k), kThreads, 0,
                                  stream>>>(acc, selected, k, static_cast<Bits*>(values),
                                            static_cast<int32_t*>(indices));
  } else {
    GatherKernel<Bits, int64_t><<<GridFor(GatherKernel<Bits, int64_t>, kThreads, k), kThreads, 0,
                                  stream>>>(acc, selected, k, static_cast<Bits*>(values),
                                            static_cast<int64_t*>(indices));
  }
  return static_cast<int>(cudaGetLastError());
}

bool ValidTopKArgs(int dtype, int64_t n, int64_t k) {
  return dtype >= TFS_F16 && dtype <= TFS_F64 && n >= 0 && n < (int64_t{1} << kIndexBits) &&
         k >= 0 && k <= n;
}

}  // namespace
}  // namespace tfs

extern "C" int tfs_topk_workspace_bytes(int dtype, int64_t n, int64_t k, size_t* bytes) {
  using namespace tfs;
  if (!ValidTopKArgs(dtype, n, k) || bytes == nullptr) return TFS_ERR_ARG;
  switch (dtype) {
    case TFS_F16:
      return WorkspaceBytes<TFS_F16>(n, k, bytes);
    case TFS_BF16:
      return WorkspaceBytes<TFS_BF16>(n, k, bytes);
    case TFS_F32:
      return WorkspaceBytes<TFS_F32>(n, k, bytes);
    default:
      return WorkspaceBytes<TFS_F64>(n, k, bytes);
  }
}

extern "C" int tfs_topk_error_feedback(int dtype, const void* grad, const void* residual,
                                       void* new_residual, int64_t n, int64_t k, void* values,
                                       void* indices, int index_bytes, void* workspace,
                                       size_t workspace_bytes, cudaStream_t stream) {
  using namespace tfs;
  if (!ValidTopKArgs(dtype, n, k) || (index_bytes != 4 && index_bytes != 8)) return TFS_ERR_ARG;
  switch (dtype) {
    case TFS_F16:
      return TopK<TFS_F16>(grad, residual, new_residual, n, k, values, indices, index_bytes,
                           workspace, workspace_bytes, stream);
    case TFS_BF16:
      return TopK<TFS_BF16>(grad, residual, new_residual, n, k, values, indices, index_bytes,
                            workspace, workspace_bytes, stream);
    case TFS_F32:
      return TopK<TFS_F32>(grad, residual, new_residual, n, k, values, indices, index_bytes,
                           workspace, workspace_bytes, stream);
    default:
      return TopK<TFS_F64>(grad, residual, new_residual, n, k, values, indices, index_bytes,
                           workspace, workspace_bytes, stream);
  }
}

extern "C" int tfs_cuda_versions(int* runtime, int* driver) {
  if (runtime == nullptr || driver == nullptr) return TFS_ERR_ARG;
  *runtime = CUDART_VERSION;
  *driver = 0;
  const cudaError_t err = cudaDriverGetVersion(driver);
  return err == cudaSuccess ? TFS_OK : static_cast<int>(err);
}

extern "C" const char* tfs_error_string(int code) {
  if (code == TFS_OK) return "ok";
  if (code == TFS_ERR_ARG) return "invalid argument (dtype, sizes, k, levels, index width or workspace)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
