// CPU kernel of ScatterSum: dense[j] = sum of values[i] over indices[i] == j, zero elsewhere.
//
// The indices are checked first (the first one outside [0, n) fails the op, named). The
// updates are then bucketed by output block of 2^15 elements with a stable counting sort, and
// the blocks are processed in parallel chunks on TF's CPU pool: each block is zero-filled and
// its updates added at once, while it is in cache, so the op costs about one zero-fill of the
// output. Within a block the updates keep their input order, so duplicates sum exactly as
// TensorFlow's UnsortedSegmentSum does on CPU (T's own addition: float16 and bfloat16 through
// float32). Everything runs under DAZ/FTZ (ScopedFlushDenormal), the ops' denormal policy.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"
#include "cpu_parallel.h"
#include "validate.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

constexpr int kBlockShift = 15;  // output blocks of 2^15 elements, summed while in cache

// InvalidArgument naming the first index outside [0, n).
template <typename Index>
absl::Status CheckIndices(const Index* indices, int64_t m, int64_t n) {
  for (int64_t i = 0; i < m; ++i) {
    const int64_t j = static_cast<int64_t>(indices[i]);
    if (j < 0 || j >= n) {
      return absl::InvalidArgumentError(absl::StrCat("ScatterSum: indices[", i, "] = ", j,
                                                     " is out of range [0, ", n, ")"));
    }
  }
  return absl::OkStatus();
}

// The (offset in block, value) pairs of each output block, in input order: block b holds
// entries [start[b], start[b + 1]).
template <typename T>
struct Bucketed {
  std::vector<int64_t> start;
  std::vector<uint32_t> offset;
  std::vector<T> value;
};

// Stable counting sort of the updates by output block (indices checked).
template <typename T, typename Index>
Bucketed<T> BucketByBlock(const T* values, const Index* indices, int64_t m, int64_t blocks) {
  constexpr int64_t kMask = (int64_t{1} << kBlockShift) - 1;
  Bucketed<T> out{std::vector<int64_t>(blocks + 1, 0), std::vector<uint32_t>(m),
                  std::vector<T>(m)};
  for (int64_t i = 0; i < m; ++i) {
    ++out.start[(static_cast<int64_t>(indices[i]) >> kBlockShift) + 1];
  }
  for (int64_t b = 0; b < blocks; ++b) out.start[b + 1] += out.start[b];
  std::vector<int64_t> next(out.start.begin(), out.start.end() - 1);
  for (int64_t i = 0; i < m; ++i) {
    const int64_t j = static_cast<int64_t>(indices[i]);
    const int64_t t = next[j >> kBlockShift]++;
    out.offset[t] = static_cast<uint32_t>(j & kMask);
    out.value[t] = values[i];
  }
  return out;
}

// Zero-fills block b of out[0:n] and adds its updates in input order.
template <typename T>
void SumBlock(const Bucketed<T>& updates, int64_t b, int64_t n, T* out) {
  T* base = out + (b << kBlockShift);
  const int64_t len = std::min(n - (b << kBlockShift), int64_t{1} << kBlockShift);
  std::memset(static_cast<void*>(base), 0, len * sizeof(T));
  for (int64_t t = updates.start[b]; t < updates.start[b + 1]; ++t) {
    T& slot = base[updates.offset[t]];
    slot = slot + updates.value[t];
  }
}

// Blocks of the output in parallel chunks, each block zero-filled and summed while in cache.
template <typename T, typename Index>
void ScatterSumCpu(OpKernelContext* ctx, const T* values, const Index* indices, int64_t m,
                   int64_t n, T* out) {
  const int64_t blocks = ((n - 1) >> kBlockShift) + 1;
  const Bucketed<T> updates = BucketByBlock(values, indices, m, blocks);
  const Chunks chunks{blocks, std::min(blocks, WorkerThreads(ctx))};
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    for (int64_t b = chunks.Begin(c); b < chunks.End(c); ++b) SumBlock(updates, b, n, out);
  });
}

template <typename T, typename Index>
class ScatterSumCpuOp : public OpKernel {
 public:
  explicit ScatterSumCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& values = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ValidateScatterSum(values, indices, ctx->input(2), &n));
    const int64_t m = values.NumElements();
    const Index* idx = indices.flat<Index>().data();
    OP_REQUIRES_OK(ctx, CheckIndices(idx, m, n));
    Tensor* dense = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &dense));
    T* out = dense->flat<T>().data();
    if (n == 0) return;
    ScatterSumCpu(ctx, values.flat<T>().data(), idx, m, n, out);
  }
};

#define TFS_REGISTER_SCATTER_CPU(T, Index)                           \
  REGISTER_KERNEL_BUILDER(Name("ScatterSum")                         \
                              .Device(DEVICE_CPU)                    \
                              .TypeConstraint<T>("T")                \
                              .TypeConstraint<Index>("Tindex"),      \
                          ScatterSumCpuOp<T, Index>);
#define TFS_REGISTER_SCATTER_CPU_ALL(T) \
  TFS_REGISTER_SCATTER_CPU(T, int32_t)  \
  TFS_REGISTER_SCATTER_CPU(T, int64_t)

TFS_REGISTER_SCATTER_CPU_ALL(Eigen::half)
TFS_REGISTER_SCATTER_CPU_ALL(Eigen::bfloat16)
TFS_REGISTER_SCATTER_CPU_ALL(float)
TFS_REGISTER_SCATTER_CPU_ALL(double)

#undef TFS_REGISTER_SCATTER_CPU_ALL
#undef TFS_REGISTER_SCATTER_CPU

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
