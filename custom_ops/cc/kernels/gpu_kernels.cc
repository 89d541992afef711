// Thin DEVICE_GPU OpKernels over the TF-free CUDA core (../../cuda). Host code only: the
// core is reached through its C API on TensorFlow's compute stream.
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tfs_cuda.h"
#include "validate.h"
#include "xla/stream_executor/stream.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

template <typename T>
constexpr int kCoreType = -1;
template <>
constexpr int kCoreType<Eigen::half> = TFS_F16;
template <>
constexpr int kCoreType<Eigen::bfloat16> = TFS_BF16;
template <>
constexpr int kCoreType<float> = TFS_F32;
template <>
constexpr int kCoreType<double> = TFS_F64;

cudaStream_t StreamOf(OpKernelContext* ctx) {
  return static_cast<cudaStream_t>(
      ctx->op_device_context()->stream()->platform_specific_handle().stream);
}

absl::Status CoreStatus(int code, const char* op) {
  if (code == TFS_OK) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(op, " (CUDA core): ", tfs_error_string(code)));
}

absl::Status Workspace(OpKernelContext* ctx, int code, size_t bytes, Tensor* out) {
  if (code != TFS_OK) return CoreStatus(code, "workspace size");
  return ctx->allocate_temp(DT_INT8, TensorShape({static_cast<int64_t>(bytes) + 1}), out);
}

template <typename T, typename Index>
class TopKErrorFeedbackGpuOp : public OpKernel {
 public:
  explicit TopKErrorFeedbackGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    const int64_t n = grad.NumElements();
    OP_REQUIRES(ctx, n < (int64_t{1} << 31),
                absl::InvalidArgumentError(absl::StrCat(
                    "TopKErrorFeedback on GPU supports fewer than 2^31 elements, got ", n,
                    "; place the op on the CPU (tf_sparsify.ops.topk_error_feedback does so "
                    "for tensors of known size)")));
    TopKOutputs out;
    // The CUDA core may write acc over residual, not over grad (declared __restrict__).
    OP_REQUIRES_OK(ctx, PrepareTopK(ctx, DataTypeToEnum<Index>::value, {1}, &out));
    const int64_t k = out.k;
    if (n == 0) return;
    size_t bytes = 0;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, Workspace(ctx, tfs_topk_workspace_bytes(kCoreType<T>, n, k, &bytes),
                                  bytes, &workspace));
    OP_REQUIRES_OK(
        ctx, CoreStatus(tfs_topk_error_feedback(
                            kCoreType<T>, grad.data(), residual.data(), out.new_residual->data(), n,
                            k, out.values->data(), out.indices->data(), sizeof(Index),
                            workspace.data(),
                            bytes, StreamOf(ctx)),
                        "TopKErrorFeedback"));
  }
};

template <typename T, typename Q>
class QsgdQuantizeGpuOp : public QsgdOpKernel {
 public:
  explicit QsgdQuantizeGpuOp(OpKernelConstruction* ctx)
      : QsgdOpKernel(ctx, "QSGDQuantize", DataTypeToEnum<Q>::value) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& input = ctx->input(0);
    const Tensor& seed = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateQsgdSeed(seed));
    const int64_t n = input.NumElements();
    Tensor* levels_out = nullptr;
    Tensor* norms_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &levels_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(
                            1, TensorShape({tfs::NumBuckets(n, bucket_size_)}), &norms_out));
    if (n == 0) return;
    size_t bytes = 0;
    Tensor workspace;
    OP_REQUIRES_OK(ctx, Workspace(ctx, tfs_qsgd_workspace_bytes(n, bucket_size_, &bytes), bytes,
                                  &workspace));
    OP_REQUIRES_OK(ctx, CoreStatus(tfs_qsgd_quantize(kCoreType<T>, input.data(), n,
                                                     static_cast<int>(levels_), bucket_size_,
                                                     seed.scalar<int64_t>()(), levels_out->data(),
                                                     norms_out->flat<float>().data(),
                                                     workspace.data(), bytes, StreamOf(ctx)),
                                   "QSGDQuantize"));
  }
};

template <typename Q, typename T>
class QsgdDequantizeGpuOp : public QsgdOpKernel {
 public:
  explicit QsgdDequantizeGpuOp(OpKernelConstruction* ctx)
      : QsgdOpKernel(ctx, "QSGDDequantize", DataTypeToEnum<Q>::value) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& levels_in = ctx->input(0);
    const Tensor& norms = ctx->input(1);
    TensorShape shape;
    OP_REQUIRES_OK(ctx,
                   ValidateDequantize(levels_in, norms, ctx->input(2), bucket_size_, &shape));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out));
    const int64_t n = levels_in.NumElements();
    if (n == 0) return;
    OP_REQUIRES_OK(ctx, CoreStatus(tfs_qsgd_dequantize(kCoreType<T>, levels_in.data(),
                                                       norms.flat<float>().data(), n,
                                                       static_cast<int>(levels_), bucket_size_,
                                                       out->data(), StreamOf(ctx)),
                                   "QSGDDequantize"));
  }
};

template <typename T, typename Index>
class ScatterSumGpuOp : public OpKernel {
 public:
  explicit ScatterSumGpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& values = ctx->input(0);
    const Tensor& indices = ctx->input(1);
    int64_t n = 0;
    OP_REQUIRES_OK(ctx, ValidateScatterSum(values, indices, ctx->input(2), &n));
    Tensor* dense = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &dense));
    OP_REQUIRES_OK(ctx, CoreStatus(tfs_scatter_sum(kCoreType<T>, values.data(), indices.data(),
                                                   sizeof(Index), values.NumElements(), n,
                                                   dense->data(), StreamOf(ctx)),
                                   "ScatterSum"));
  }
};

#define TFS_REGISTER_GPU(T)                                                              \
  REGISTER_KERNEL_BUILDER(Name("TopKErrorFeedback")                                      \
                              .Device(DEVICE_GPU)                                        \
                              .HostMemory("k")                                           \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<int32_t>("index_type"),                    \
                          TopKErrorFeedbackGpuOp<T, int32_t>);                           \
  REGISTER_KERNEL_BUILDER(Name("TopKErrorFeedback")                                      \
                              .Device(DEVICE_GPU)                                        \
                              .HostMemory("k")                                           \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<int64_t>("index_type"),                    \
                          TopKErrorFeedbackGpuOp<T, int64_t>);                           \
  REGISTER_KERNEL_BUILDER(Name("QSGDQuantize")                                           \
                              .Device(DEVICE_GPU)                                        \
                              .HostMemory("seed")                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<int8_t>("out_type"),                       \
                          QsgdQuantizeGpuOp<T, int8_t>);                                 \
  REGISTER_KERNEL_BUILDER(Name("QSGDQuantize")                                           \
                              .Device(DEVICE_GPU)                                        \
                              .HostMemory("seed")                                        \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<int16_t>("out_type"),                      \
                          QsgdQuantizeGpuOp<T, int16_t>);                                \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("QSGDDequantize").Device(DEVICE_GPU).HostMemory("shape").TypeConstraint<int8_t>( \
          "Tq").TypeConstraint<T>("dtype"),                                              \
      QsgdDequantizeGpuOp<int8_t, T>);                                                   \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("QSGDDequantize").Device(DEVICE_GPU).HostMemory("shape").TypeConstraint<int16_t>( \
          "Tq").TypeConstraint<T>("dtype"),                                              \
      QsgdDequantizeGpuOp<int16_t, T>);                                                  \
  REGISTER_KERNEL_BUILDER(Name("ScatterSum")                                             \
                              .Device(DEVICE_GPU)                                        \
                              .HostMemory("n")                                           \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<int32_t>("Tindex"),                        \
                          ScatterSumGpuOp<T, int32_t>);                                  \
  REGISTER_KERNEL_BUILDER(Name("ScatterSum")                                             \
                              .Device(DEVICE_GPU)                                        \
                              .HostMemory("n")                                           \
                              .TypeConstraint<T>("T")                                    \
                              .TypeConstraint<int64_t>("Tindex"),                        \
                          ScatterSumGpuOp<T, int64_t>);

TFS_REGISTER_GPU(Eigen::half)
TFS_REGISTER_GPU(Eigen::bfloat16)
TFS_REGISTER_GPU(float)
TFS_REGISTER_GPU(double)

#undef TFS_REGISTER_GPU

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
