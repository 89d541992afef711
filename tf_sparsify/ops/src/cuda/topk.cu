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
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>

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

template <int Dtype>
struct Elem;
template <>
struct Elem<TFS_F16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    const float s = __fadd_rn(__half2float(__ushort_as_half(a)), __half2float(__ushort_as_half(b)));
    return __half_as_ushort(__float2half_rn(s));
  }
};
template <>
struct Elem<TFS_BF16> {
  using Bits = uint16_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    const float s = __fadd_rn(__bfloat162float(__ushort_as_bfloat16(a)),
                              __bfloat162float(__ushort_as_bfloat16(b)));
    return __bfloat16_as_ushort(__float2bfloat16_rn(s));
  }
};
template <>
struct Elem<TFS_F32> {
  using Bits = uint32_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    return __float_as_uint(__fadd_rn(__uint_as_float(a), __uint_as_float(b)));
  }
};
template <>
struct Elem<TFS_F64> {
  using Bits = uint64_t;
  static __device__ __forceinline__ Bits Add(Bits a, Bits b) {
    return static_cast<Bits>(__double_as_longlong(
        __dadd_rn(__longlong_as_double(static_cast<long long>(a)),
                  __longlong_as_double(static_cast<long long>(b)))));
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
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = vectorized ? n / V::kN : 0;
  for (int64_t v = tid; v < nvec; v += stride) {
    const V a = reinterpret_cast<const V*>(grad)[v];
    const V b = reinterpret_cast<const V*>(residual)[v];
    V s;
#pragma unroll
    for (int j = 0; j < V::kN; ++j) {
      s.v[j] = Elem<Dtype>::Add(a.v[j], b.v[j]);
      if (with_hist) atomicAdd(sh + (KeyBits(s.v[j]) >> shift), 1u);
    }
    reinterpret_cast<V*>(acc)[v] = s;
  }
  for (int64_t i = nvec * V::kN + tid; i < n; i += stride) {
    const Bits s = Elem<Dtype>::Add(grad[i], residual[i]);
    acc[i] = s;
    if (with_hist) atomicAdd(sh + (KeyBits(s) >> shift), 1u);
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
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = vectorized ? n / V::kN : 0;
  for (int64_t v = tid; v < nvec; v += stride) {
    const V a = reinterpret_cast<const V*>(acc)[v];
#pragma unroll
    for (int j = 0; j < V::kN; ++j) {
      const Bits key = KeyBits(a.v[j]);
      if (static_cast<Bits>(key - lo) <= span) atomicAdd(sh + ((key >> shift) & mask), 1u);
    }
  }
  for (int64_t i = nvec * V::kN + tid; i < n; i += stride) {
    const Bits key = KeyBits(acc[i]);
    if (static_cast<Bits>(key - lo) <= span) atomicAdd(sh + ((key >> shift) & mask), 1u);
  }
  FlushShared(sh, hist);
}

// Histograms digit (i >> shift) & mask of the indices of the ties inside the index band.
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
  for (int64_t i = st->ilo + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < end; i += stride) {
    if (KeyBits(acc[i]) == kth) atomicAdd(sh + ((i >> shift) & mask), 1u);
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
    return key > static_cast<Bits>(st->hi) ||
           (key >= static_cast<Bits>(st->lo) && static_cast<long long>(i) <= st->idx_limit);
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

int GridFor(int64_t work) {
  int device = 0;
  int sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    sms = 108;
  }
  const int64_t full = static_cast<int64_t>(sms) * (2048 / kThreads);
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(wanted < 1 ? 1 : (wanted < full ? wanted : full));
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
  const int grid = GridFor(n / Vec<Bits>::kN + 1);
  if (n == 0) return TFS_OK;
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
    RefineKeyKernel<Bits><<<grid, kThreads, 0, stream>>>(acc, n, vectorized, st, next,
                                                         bins - 1, hist);
    FindDigitKernel<false><<<1, kFindThreads, 0, stream>>>(hist, bins, next, st);
    shift = next;
  }
  for (int bit = kIndexBits; bit > 0;) {
    const int next = bit > kDigitBits ? bit - kDigitBits : 0;
    const int bins = 1 << (bit - next);
    RefineTieKernel<Bits><<<grid, kThreads, 0, stream>>>(acc, n, st, next, bins - 1, hist);
    FindDigitKernel<true><<<1, kFindThreads, 0, stream>>>(hist, bins, next, st);
    bit = next;
  }
  size_t cub_bytes = layout.cub_bytes;
  err = cub::DeviceSelect::If(ws + layout.cub, cub_bytes, thrust::counting_iterator<int>(0),
                              selected, count, static_cast<int>(n), IsSelected<Bits>{acc, st},
                              stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  const int gather_grid = GridFor(k);
  if (index_bytes == 4) {
    GatherKernel<Bits, int32_t><<<gather_grid, kThreads, 0, stream>>>(
        acc, selected, k, static_cast<Bits*>(values), static_cast<int32_t*>(indices));
  } else {
    GatherKernel<Bits, int64_t><<<gather_grid, kThreads, 0, stream>>>(
        acc, selected, k, static_cast<Bits*>(values), static_cast<int64_t*>(indices));
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

extern "C" const char* tfs_error_string(int code) {
  if (code == TFS_OK) return "ok";
  if (code == TFS_ERR_ARG) return "invalid argument (dtype, sizes, k, levels or workspace)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}
