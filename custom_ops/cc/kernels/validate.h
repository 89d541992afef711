// Argument checks shared by the CPU and GPU OpKernels: every failure is an InvalidArgument
// error that names the argument and its value.
#ifndef TFS_KERNELS_VALIDATE_H_
#define TFS_KERNELS_VALIDATE_H_

#include <initializer_list>
#include <cstdint>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfs_common.h"

namespace tensorflow {
namespace tfs_ops {

// Reads the scalar k and checks grad/residual shapes, 0 <= k <= n and that n fits the index type.
inline absl::Status ValidateTopK(const Tensor& grad, const Tensor& residual, const Tensor& k_t,
                                 DataType index_type, int64_t* k) {
  if (grad.shape() != residual.shape()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TopKErrorFeedback: residual must have the shape of grad ",
                     grad.shape().DebugString(), ", got residual shape ",
                     residual.shape().DebugString()));
  }
  if (!TensorShapeUtils::IsScalar(k_t.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TopKErrorFeedback: k must be a scalar, got shape ", k_t.shape().DebugString()));
  }
  *k = k_t.dtype() == DT_INT32 ? static_cast<int64_t>(k_t.scalar<int32_t>()())
                               : k_t.scalar<int64_t>()();
  const int64_t n = grad.NumElements();
  if (*k < 0 || *k > n) {
    return absl::InvalidArgumentError(
        absl::StrCat("TopKErrorFeedback: k must be in [0, ", n, "] (the number of elements of ",
                     "grad), got k = ", *k));
  }
  if (index_type == DT_INT32 && n > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("TopKErrorFeedback: index_type int32 cannot index ", n,
                     " elements; use index_type int64 (index_dtype=tf.int64)"));
  }
  return absl::OkStatus();
}

// levels in [1, 32767], bucket_size >= 0 (sizes above n mean one bucket), and the payload type
// the levels need.
inline absl::Status ValidateQsgdAttrs(const char* op, int64_t levels, int64_t bucket_size,
                                      DataType level_type) {
  if (levels < 1 || levels > tfs::kMaxLevels) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": levels must be in [1, ",
                                                   tfs::kMaxLevels, "], got levels = ", levels));
  }
  if (bucket_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": bucket_size must be >= 0 (0 = one bucket), got bucket_size = ", bucket_size));
  }
  const DataType want = levels <= 127 ? DT_INT8 : DT_INT16;
  if (level_type != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": levels = ", levels, " needs signed levels of type ",
                     DataTypeString(want), ", got ", DataTypeString(level_type)));
  }
  return absl::OkStatus();
}

inline absl::Status ValidateQsgdSeed(const Tensor& seed) {
  if (!TensorShapeUtils::IsScalar(seed.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QSGDQuantize: seed must be a scalar, got shape ", seed.shape().DebugString()));
  }
  return absl::OkStatus();
}

// Builds the output shape and checks it against the payload and the number of norms.
inline absl::Status ValidateDequantize(const Tensor& levels_t, const Tensor& norms,
                                       const Tensor& shape_t, int64_t bucket_size,
                                       TensorShape* shape) {
  if (!TensorShapeUtils::IsVector(shape_t.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QSGDDequantize: shape must be a vector, got shape ", shape_t.shape().DebugString()));
  }
  absl::Status s = shape_t.dtype() == DT_INT32
                       ? TensorShapeUtils::MakeShape(shape_t.vec<int32_t>(), shape)
                       : TensorShapeUtils::MakeShape(shape_t.vec<int64_t>(), shape);
  if (!s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("QSGDDequantize: invalid shape: ", s.message()));
  }
  const int64_t n = levels_t.NumElements();
  if (shape->num_elements() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QSGDDequantize: shape ", shape->DebugString(), " has ", shape->num_elements(),
        " elements but signed_levels has ", n));
  }
  const int64_t buckets = tfs::NumBuckets(n, bucket_size);
  if (!TensorShapeUtils::IsVector(norms.shape()) || norms.NumElements() != buckets) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QSGDDequantize: norms must be a vector of ", buckets, " bucket norms (", n,
        " elements, bucket_size = ", bucket_size, "), got shape ", norms.shape().DebugString()));
  }
  return absl::OkStatus();
}

// Base of the QSGD kernels (CPU and GPU): reads and checks the levels and bucket_size attrs.
class QsgdOpKernel : public OpKernel {
 public:
  QsgdOpKernel(OpKernelConstruction* ctx, const char* op, DataType level_type) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("levels", &levels_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("bucket_size", &bucket_size_));
    OP_REQUIRES_OK(ctx, ValidateQsgdAttrs(op, levels_, bucket_size_, level_type));
  }

 protected:
  int64_t levels_ = 0;
  int64_t bucket_size_ = 0;
};

// TopKErrorFeedback's checked k and its outputs, for the CPU and GPU kernels.
struct TopKOutputs {
  int64_t k = 0;
  Tensor* values = nullptr;
  Tensor* indices = nullptr;
  Tensor* new_residual = nullptr;
};

// Validates the inputs and allocates the outputs; new_residual reuses the buffer of one of
// `forwardable` (input indices: 0 grad, 1 residual) when TensorFlow allows it (a buffer no one
// else holds: a gradient is usually dead after this op), so no fresh memory is touched.
inline absl::Status PrepareTopK(OpKernelContext* ctx, DataType index_type,
                                std::initializer_list<int> forwardable, TopKOutputs* out) {
  const Tensor& grad = ctx->input(0);
  absl::Status s = ValidateTopK(grad, ctx->input(1), ctx->input(2), index_type, &out->k);
  if (!s.ok()) return s;
  s = ctx->allocate_output(0, TensorShape({out->k}), &out->values);
  if (!s.ok()) return s;
  s = ctx->allocate_output(1, TensorShape({out->k}), &out->indices);
  if (!s.ok()) return s;
  return ctx->forward_input_or_allocate_output(forwardable, 2, grad.shape(), &out->new_residual);
}

// ScatterSum: values and indices vectors of one length, n a scalar >= 0 (read into *n).
inline absl::Status ValidateScatterSum(const Tensor& values, const Tensor& indices,
                                       const Tensor& n_t, int64_t* n) {
  if (!TensorShapeUtils::IsVector(values.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScatterSum: values must be a vector, got shape ", values.shape().DebugString()));
  }
  if (!TensorShapeUtils::IsVector(indices.shape())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScatterSum: indices must be a vector, got shape ", indices.shape().DebugString()));
  }
  if (indices.NumElements() != values.NumElements()) {
    return absl::InvalidArgumentError(
        absl::StrCat("ScatterSum: indices must have the length of values (",
                     values.NumElements(), "), got ", indices.NumElements()));
  }
  if (!TensorShapeUtils::IsScalar(n_t.shape())) {
    return absl::InvalidArgumentError(
        absl::StrCat("ScatterSum: n must be a scalar, got shape ", n_t.shape().DebugString()));
  }
  *n = n_t.scalar<int64_t>()();
  if (*n < 0) {
    return absl::InvalidArgumentError(absl::StrCat("ScatterSum: n must be >= 0, got n = ", *n));
  }
  return absl::OkStatus();
}

}  // namespace tfs_ops
}  // namespace tensorflow

#endif  // TFS_KERNELS_VALIDATE_H_
