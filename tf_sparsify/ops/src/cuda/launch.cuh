// Launch helpers of the CUDA core: grid sizes from the occupancy API and warp-aggregated
// shared-memory histogram increments.
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

// Adds one to sh[bin] for every lane where `valid`; lanes of the warp that share a bin add
// once, through their lowest lane. All 32 lanes must call it together (warp-uniform loops).
__device__ __forceinline__ void WarpHistogramAdd(unsigned* sh, unsigned bin, bool valid) {
  const unsigned key = valid ? bin : 0xFFFFFFFFu;
  const unsigned peers = __match_any_sync(0xFFFFFFFFu, key);
  if (valid && static_cast<int>(threadIdx.x & 31u) == __ffs(peers) - 1) {
    atomicAdd(sh + bin, static_cast<unsigned>(__popc(peers)));
  }
}

// First index of this thread's warp in a grid of warps (a grid-stride loop over it with
// `base + lane` stays warp-uniform).
__device__ __forceinline__ int64_t WarpBase() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + (threadIdx.x & ~31u);
}

}  // namespace tfs

#endif  // TFS_LAUNCH_CUH_
