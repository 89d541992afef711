// Contiguous chunks of a flat range run on TensorFlow's CPU pool, shared by the CPU kernels.
#ifndef TFS_KERNELS_CPU_PARALLEL_H_
#define TFS_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/platform/denormal.h"
#include "tensorflow/core/platform/threadpool.h"

namespace tensorflow {
namespace tfs_ops {

// Fixed partition of [0, n) into `count` contiguous chunks.
struct Chunks {
  int64_t n;
  int64_t count;
  int64_t Begin(int64_t c) const { return n / count * c + std::min(c, n % count); }
  int64_t End(int64_t c) const { return Begin(c + 1); }
};

// Threads of TF's CPU pool (at least 1).
inline int64_t WorkerThreads(OpKernelContext* ctx) {
  return std::max(1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
}

// Runs fn(c) for c in [0, count) on TF's CPU pool (the caller's thread when count is 1),
// under DAZ/FTZ.
inline void ForEachChunk(OpKernelContext* ctx, int64_t count,
                         const std::function<void(int64_t)>& fn) {
  if (count == 1) {
    fn(0);
    return;
  }
  ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      count, thread::ThreadPool::SchedulingParams::Fixed(1), [&fn](int64_t begin, int64_t end) {
        port::ScopedFlushDenormal flush;
        for (int64_t c = begin; c < end; ++c) fn(c);
      });
}

// `items` dealt onto at most `threads` lists for ForEachChunk: largest cost first, each onto the
// least loaded list (cost(i) is item i's estimated work).
template <typename Cost>
std::vector<std::vector<int>> LeastLoadedGroups(std::vector<int> items, int64_t threads,
                                                const Cost& cost) {
  std::stable_sort(items.begin(), items.end(), [&](int a, int b) { return cost(a) > cost(b); });
  const int64_t count = std::min<int64_t>(threads, items.size());
  std::vector<std::vector<int>> groups(count);
  std::vector<int64_t> load(count, 0);
  for (int i : items) {
    const int64_t g = std::min_element(load.begin(), load.end()) - load.begin();
    groups[g].push_back(i);
    load[g] += cost(i);
  }
  return groups;
}

}  // namespace tfs_ops
}  // namespace tensorflow

#endif  // TFS_KERNELS_CPU_PARALLEL_H_
