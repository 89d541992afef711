// CPU kernel of SparseSgdApply: plain SGD steps with gathered sparse updates, applied to the
// variable in place, so that a TopK step never builds (zero-fills, scales and subtracts) the
// dense update.
//
// values and indices are [rows, k] (one row per replica, each row's indices strictly
// ascending, checked before the variable changes). Row after row, var[i] -= (value * scale) *
// learning_rate in T's arithmetic, so with one row, or rows that share no index, the result is
// bit-identical to the dense path (ScatterSum, Mul by scale, Keras SGD's assign_sub of
// gradient * learning_rate); where rows share an index it differs by the rounding of adding
// the rows' steps one at a time instead of their sum. Disjoint ranges of the variable run in
// parallel on TF's CPU pool (each row's slice found by binary search). Under the variable's
// exclusive lock its buffer is copied first when a read still holds it (or the variable is in
// copy-on-read mode), as AssignSubVariableOp does.
#include <algorithm>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"
#include "cpu_parallel.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

// InvalidArgument naming the first index outside [0, n) or out of ascending order in its row.
template <typename Index>
absl::Status CheckRows(const Index* indices, int64_t rows, int64_t k, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    const Index* row = indices + r * k;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t x = static_cast<int64_t>(row[j]);
      if (x < 0 || x >= n) {
        return absl::InvalidArgumentError(
            absl::StrCat("SparseSgdApply: indices[", r, ", ", j, "] = ", x,
                         " is out of range [0, ", n, ") (the number of elements of var)"));
      }
      if (j > 0 && x <= static_cast<int64_t>(row[j - 1])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "SparseSgdApply: each row of indices must be strictly ascending, got indices[", r,
            ", ", j, "] = ", x, " after ", static_cast<int64_t>(row[j - 1])));
      }
    }
  }
  return absl::OkStatus();
}

// data[i] -= (values[r, j] * scale) * lr for the entries with i = indices[r, j] in [lo, hi),
// row after row.
template <typename T, typename Index>
void ApplyRange(const T* values, const Index* indices, int64_t rows, int64_t k, int64_t lo,
                int64_t hi, T scale, T lr, T* data) {
  for (int64_t r = 0; r < rows; ++r) {
    const Index* row = indices + r * k;
    const T* value = values + r * k;
    const int64_t begin = std::lower_bound(row, row + k, lo) - row;
    const int64_t end = std::lower_bound(row + begin, row + k, hi) - row;
    for (int64_t j = begin; j < end; ++j) {
      const int64_t i = static_cast<int64_t>(row[j]);
      data[i] = data[i] - (value[j] * scale) * lr;
    }
  }
}

// The variable's buffer, copied first when a read still holds it (call with var's lock held).
absl::Status PrepareToUpdate(OpKernelContext* ctx, Var* var) {
  Tensor* tensor = var->tensor();
  if (!var->copy_on_read_mode.load() && tensor->RefCountIsOne()) return absl::OkStatus();
  AllocatorAttributes attr;
  attr.set_gpu_compatible(true);
  attr.set_nic_compatible(true);
  Tensor copy;
  TF_RETURN_IF_ERROR(ctx->allocate_temp(tensor->dtype(), tensor->shape(), &copy, attr));
  std::memcpy(copy.data(), tensor->data(), tensor->TotalBytes());
  *tensor = copy;
  return absl::OkStatus();
}

template <typename T, typename Index>
class SparseSgdApplyCpuOp : public OpKernel {
 public:
  explicit SparseSgdApplyCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& values = ctx->input(1);
    const Tensor& indices = ctx->input(2);
    const Tensor& scale = ctx->input(3);
    const Tensor& learning_rate = ctx->input(4);
    OP_REQUIRES(ctx, values.dims() == 2 && indices.shape() == values.shape(),
                absl::InvalidArgumentError(absl::StrCat(
                    "SparseSgdApply: values and indices must be [rows, k] of one shape, got ",
                    values.shape().DebugString(), " and ", indices.shape().DebugString())));
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsScalar(scale.shape()) &&
                    TensorShapeUtils::IsScalar(learning_rate.shape()),
                absl::InvalidArgumentError(absl::StrCat(
                    "SparseSgdApply: scale and learning_rate must be scalars, got shapes ",
                    scale.shape().DebugString(), " and ", learning_rate.shape().DebugString())));
    core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &var));
    mutex_lock lock(*var->mu());
    const Tensor& current = *var->tensor();
    OP_REQUIRES(ctx, current.IsInitialized(),
                absl::FailedPreconditionError("SparseSgdApply: var is not initialized"));
    OP_REQUIRES(ctx, current.dtype() == DataTypeToEnum<T>::v(),
                absl::InvalidArgumentError(absl::StrCat(
                    "SparseSgdApply: var has dtype ", DataTypeString(current.dtype()),
                    ", values have dtype ", DataTypeString(DataTypeToEnum<T>::v()))));
    const int64_t rows = values.dim_size(0), k = values.dim_size(1);
    const Index* idx = indices.flat<Index>().data();
    OP_REQUIRES_OK(ctx, CheckRows(idx, rows, k, current.NumElements()));
    OP_REQUIRES_OK(ctx, PrepareToUpdate(ctx, var.get()));
    T* data = var->tensor()->flat<T>().data();
    const T s = scale.scalar<T>()();
    const T lr = learning_rate.scalar<T>()();
    const T* v = values.flat<T>().data();
    const int64_t n = var->tensor()->NumElements();
    // disjoint ranges of var in parallel, each with its own slices of the rows
    const Chunks chunks{n, std::max<int64_t>(1, std::min(WorkerThreads(ctx), rows * k / 4096))};
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      ApplyRange(v, idx, rows, k, chunks.Begin(c), chunks.End(c), s, lr, data);
    });
  }
};

#define TFS_REGISTER_SPARSE_SGD_CPU(T, Index)                         \
  REGISTER_KERNEL_BUILDER(Name("SparseSgdApply")                      \
                              .Device(DEVICE_CPU)                     \
                              .TypeConstraint<T>("T")                 \
                              .TypeConstraint<Index>("Tindex"),       \
                          SparseSgdApplyCpuOp<T, Index>);
#define TFS_REGISTER_SPARSE_SGD_CPU_ALL(T) \
  TFS_REGISTER_SPARSE_SGD_CPU(T, int32_t)  \
  TFS_REGISTER_SPARSE_SGD_CPU(T, int64_t)

TFS_REGISTER_SPARSE_SGD_CPU_ALL(Eigen::half)
TFS_REGISTER_SPARSE_SGD_CPU_ALL(Eigen::bfloat16)
TFS_REGISTER_SPARSE_SGD_CPU_ALL(float)
TFS_REGISTER_SPARSE_SGD_CPU_ALL(double)

#undef TFS_REGISTER_SPARSE_SGD_CPU_ALL
#undef TFS_REGISTER_SPARSE_SGD_CPU

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
