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
#include <string>
#include <vector>

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

constexpr int64_t kMinEntries = 4096;  // entries per thread, at least

// InvalidArgument naming the first index outside [0, n) or out of ascending order in its row
// (rows of k entries, `stride` apart; the message starts with `op` and names the indices
// `what`).
template <typename Index>
absl::Status CheckRows(const Index* indices, int64_t rows, int64_t k, int64_t stride, int64_t n,
                       const char* op, const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    const Index* row = indices + r * stride;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t x = static_cast<int64_t>(row[j]);
      if (x < 0 || x >= n) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": ", what, "[", r, ", ", j, "] = ", x, " is out of range [0, ", n,
                         ") (the number of elements of its var)"));
      }
      if (j > 0 && x <= static_cast<int64_t>(row[j - 1])) {
        return absl::InvalidArgumentError(absl::StrCat(
            op, ": each row of ", what, " must be strictly ascending, got ", what, "[", r, ", ",
            j, "] = ", x, " after ", static_cast<int64_t>(row[j - 1])));
      }
    }
  }
  return absl::OkStatus();
}

// InvalidArgument unless scale and learning_rate are scalars (`op` names the op).
absl::Status CheckScalars(const char* op, const Tensor& scale, const Tensor& learning_rate) {
  if (TensorShapeUtils::IsScalar(scale.shape()) &&
      TensorShapeUtils::IsScalar(learning_rate.shape())) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": scale and learning_rate must be scalars, got shapes ",
                   scale.shape().DebugString(), " and ", learning_rate.shape().DebugString()));
}

// data[i] -= (values[r, j] * scale) * lr for the entries with i = indices[r, j] in [lo, hi),
// row after row (rows of k entries, `stride` apart).
template <typename T, typename Index>
void ApplyRange(const T* values, const Index* indices, int64_t rows, int64_t k, int64_t stride,
                int64_t lo, int64_t hi, T scale, T lr, T* data) {
  for (int64_t r = 0; r < rows; ++r) {
    const Index* row = indices + r * stride;
    const T* value = values + r * stride;
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
    OP_REQUIRES_OK(ctx, CheckScalars("SparseSgdApply", scale, learning_rate));
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
    OP_REQUIRES_OK(ctx,
                   CheckRows(idx, rows, k, k, current.NumElements(), "SparseSgdApply", "indices"));
    OP_REQUIRES_OK(ctx, PrepareToUpdate(ctx, var.get()));
    T* data = var->tensor()->flat<T>().data();
    const T s = scale.scalar<T>()();
    const T lr = learning_rate.scalar<T>()();
    const T* v = values.flat<T>().data();
    const int64_t n = var->tensor()->NumElements();
    // disjoint ranges of var in parallel, each with its own slices of the rows
    const Chunks chunks{n,
                        std::max<int64_t>(1, std::min(WorkerThreads(ctx), rows * k / kMinEntries))};
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      ApplyRange(v, idx, rows, k, k, chunks.Begin(c), chunks.End(c), s, lr, data);
    });
  }
};

// SparseSgdApplyPacked: SparseSgdApply of N variables in one op; variable i's entries are the
// ks[i] columns of values and indices after those of the variables before it. Every variable
// is checked (initialized, dtype, indices) before any changes; then the variables are updated
// side by side, each whole on one thread under its own lock, largest k first onto the least
// loaded thread.
template <typename T, typename Index>
class SparseSgdApplyPackedCpuOp : public OpKernel {
 public:
  explicit SparseSgdApplyPackedCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ks", &ks_));
  }

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const int num = ctx->num_inputs() - 4;
    const Tensor& values = ctx->input(num);
    const Tensor& indices = ctx->input(num + 1);
    const Tensor& scale = ctx->input(num + 2);
    const Tensor& learning_rate = ctx->input(num + 3);
    OP_REQUIRES(ctx, static_cast<int>(ks_.size()) == num,
                absl::InvalidArgumentError(absl::StrCat(
                    "SparseSgdApplyPacked: ks must have one k per variable (", num, "), got ",
                    ks_.size())));
    int64_t total = 0;
    for (int i = 0; i < num; ++i) {
      OP_REQUIRES(ctx, ks_[i] >= 0,
                  absl::InvalidArgumentError(
                      absl::StrCat("SparseSgdApplyPacked: ks[", i, "] = ", ks_[i], " < 0")));
      total += ks_[i];
    }
    OP_REQUIRES(ctx,
                values.dims() == 2 && indices.shape() == values.shape() &&
                    values.dim_size(1) == total,
                absl::InvalidArgumentError(absl::StrCat(
                    "SparseSgdApplyPacked: values and indices must be [rows, sum(ks) = ", total,
                    "] of one shape, got ", values.shape().DebugString(), " and ",
                    indices.shape().DebugString())));
    OP_REQUIRES_OK(ctx, CheckScalars("SparseSgdApplyPacked", scale, learning_rate));
    const int64_t rows = values.dim_size(0);
    const Index* idx = indices.flat<Index>().data();
    const T* v = values.flat<T>().data();
    std::vector<core::RefCountPtr<Var>> vars(num);
    std::vector<int64_t> first(num + 1, 0);
    for (int i = 0; i < num; ++i) {
      first[i + 1] = first[i] + ks_[i];
      OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, i), &vars[i]));
      tf_shared_lock lock(*vars[i]->mu());
      const Tensor& current = *vars[i]->tensor();
      OP_REQUIRES(ctx, current.IsInitialized(),
                  absl::FailedPreconditionError(absl::StrCat(
                      "SparseSgdApplyPacked: vars[", i, "] is not initialized")));
      OP_REQUIRES(ctx, current.dtype() == DataTypeToEnum<T>::v(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "SparseSgdApplyPacked: vars[", i, "] has dtype ",
                      DataTypeString(current.dtype()), ", values have dtype ",
                      DataTypeString(DataTypeToEnum<T>::v()))));
      OP_REQUIRES_OK(ctx, CheckRows(idx + first[i], rows, ks_[i], total, current.NumElements(),
                                    "SparseSgdApplyPacked",
                                    absl::StrCat("indices of vars[", i, "]")));
    }
    const T s = scale.scalar<T>()();
    const T lr = learning_rate.scalar<T>()();
    std::vector<int> all(num);
    for (int i = 0; i < num; ++i) all[i] = i;
    const int64_t threads =
        std::max<int64_t>(1, std::min(WorkerThreads(ctx), rows * total / kMinEntries));
    const auto groups = LeastLoadedGroups(all, threads, [&](int i) { return ks_[i] + 1; });
    std::vector<absl::Status> status(groups.size());
    ForEachChunk(ctx, groups.size(), [&](int64_t g) {
      for (int i : groups[g]) {
        mutex_lock lock(*vars[i]->mu());
        status[g] = PrepareToUpdate(ctx, vars[i].get());
        if (!status[g].ok()) return;
        Tensor* tensor = vars[i]->tensor();
        ApplyRange(v + first[i], idx + first[i], rows, ks_[i], total, 0, tensor->NumElements(), s,
                   lr, tensor->flat<T>().data());
      }
    });
    for (const absl::Status& st : status) OP_REQUIRES_OK(ctx, st);
  }

 private:
  std::vector<int64_t> ks_;
};

#define TFS_REGISTER_SPARSE_SGD_CPU(T, Index)                         \
  REGISTER_KERNEL_BUILDER(Name("SparseSgdApply")                      \
                              .Device(DEVICE_CPU)                     \
                              .TypeConstraint<T>("T")                 \
                              .TypeConstraint<Index>("Tindex"),       \
                          SparseSgdApplyCpuOp<T, Index>);     \
  REGISTER_KERNEL_BUILDER(Name("SparseSgdApplyPacked")                \
                              .Device(DEVICE_CPU)                     \
                              .TypeConstraint<T>("T")                 \
                              .TypeConstraint<Index>("Tindex"),       \
                          SparseSgdApplyPackedCpuOp<T, Index>);
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
