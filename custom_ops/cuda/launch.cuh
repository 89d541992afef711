// Launch helpers of the CUDA core: grid sizes from the occupancy API and shared-memory
// histogram increments aggregated for warps whose keys are all equal.
#ifndef TFS_LAUNCH_CUH_
#define TFS_LAUNCH_CUH_

#include <cuda_runtime.h>

#include <cstdint>

namespace tfs {

// Blocks for `work` items of a grid-stride kernel: one per `threads` items, at most as many as
// fit on the device at once (occupancy of this kernel, registers and shared memory included).
template <typename Kernel>
int GridFor(Kernel kernel, int threads, int64_t work) {
  int device = 0;
  int sms = 0;
  int per_sm = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
      sms < 1) {
    sms = 1;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0) != cudaSuccess ||
      per_sm < 1) {
    per_sm = 1;
  }
  const int64_t full = static_cast<int64_t>(sms) * per_sm;
  const int64_t wanted = (work + threads - 1) / threads;
  return static_cast<int>(wanted < 1 ? 1 : (wanted < full ? wanted : full));
}

// Adds one to sh[bin] for every lane where `valid`. When all valid lanes of the warp share
// one bin (zeros, constant gradients) their lowest lane adds their count once; otherwise each
// valid lane adds one (random keys rarely collide, and a ballot, a shuffle and a vote cost far
// less than __match_any_sync). All 32 lanes must call it together (warp-uniform loops).
__device__ __forceinline__ void WarpHistogramAdd(unsigned* sh, unsigned bin, bool valid) {
  const unsigned active = __ballot_sync(0xFFFFFFFFu, valid);
  if (active == 0u) return;
  const int leader = __ffs(active) - 1;
  const unsigned first = __shfl_sync(0xFFFFFFFFu, bin, leader);
  if (__all_sync(0xFFFFFFFFu, !valid || bin == first)) {
    if (static_cast<int>(threadIdx.x & 31u) == leader) atomicAdd(sh + first, __popc(active));
  } else if (valid) {
    atomicAdd(sh + bin, 1u);
  }
}

// First index of this thread's warp in a grid of warps (a grid-stride loop over it with
// `base + lane` stays warp-uniform).
__device__ __forceinline__ int64_t WarpBase() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u);
}

}  // namespace tfs

#endif  // TFS_LAUNCH_CUH_
