// CPU kernels of QSGDQuantize and QSGDDequantize.
//
// Bucket norms follow the reference's fixed summation order: each bucket is zero-padded to a
// power of two P and squares (float64) are added in a tree of adjacent pairs. The tree is cut
// into aligned blocks of kNormBlock entries, summed in parallel, then combined in the same
// tree; zero padding is skipped since adding +0.0 to a sum of squares changes nothing.
//
// Everything runs under DAZ/FTZ (ScopedFlushDenormal), the ops' denormal policy.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tensorflow/core/util/work_sharder.h"
#include "f16c.h"
#include "tfs_common.h"
#include "validate.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

constexpr int64_t kNormBlock = 4096;
constexpr int kLeaf = 32;
constexpr int64_t kHalfBlock = 256;  // float32 results converted to float16 at once

// QSGD's float32 view of an input (tfs::QsgdInput).
template <typename T>
inline float Input(T v) {
  if constexpr (std::is_same_v<T, double>) {
    return tfs::QsgdInput(v);
  } else {
    return tfs::QsgdInput(static_cast<float>(v));
  }
}

template <typename T>
inline double Square(T v) {
  const double d = static_cast<double>(Input(v));
  return d * d;
}

// Pairwise-tree sum of squares of x[0:len] zero-padded to `width` (a power of two).
template <typename T>
double TreeSumOfSquares(const T* x, int64_t len, int64_t width) {
  if (width <= kLeaf) {
    double buf[kLeaf];
    for (int64_t j = 0; j < width; ++j) buf[j] = j < len ? Square(x[j]) : 0.0;
    for (int64_t w = width / 2; w >= 1; w /= 2) {
      for (int64_t j = 0; j < w; ++j) buf[j] = buf[2 * j] + buf[2 * j + 1];
    }
    return buf[0];
  }
  const int64_t half = width / 2;
  if (len <= half) return TreeSumOfSquares(x, len, half);
  return TreeSumOfSquares(x, half, half) + TreeSumOfSquares(x + half, len - half, half);
}

// Runs fn over [0, total) in parallel shards of about `cost` cycles per unit, under DAZ/FTZ.
void Parallel(OpKernelContext* ctx, int64_t total, int64_t cost,
              const std::function<void(int64_t, int64_t)>& fn) {
  const auto* workers = ctx->device()->tensorflow_cpu_worker_threads();
  Shard(workers->num_threads, workers->workers, total, cost, [&fn](int64_t begin, int64_t end) {
    port::ScopedFlushDenormal flush;
    fn(begin, end);
  });
}

template <typename T>
void BucketNorms(OpKernelContext* ctx, const T* x, int64_t n, int64_t bucket_size, float* norms) {
  const int64_t b = tfs::EffectiveBucket(n, bucket_size);
  const int64_t buckets = tfs::NumBuckets(n, bucket_size);
  const int64_t width = tfs::Pow2Ceil(b);
  const int64_t block = std::min(width, kNormBlock);
  const int64_t per_bucket = width / block;
  std::vector<double> sums(buckets * per_bucket, 0.0);
  Parallel(ctx, buckets * per_bucket, block * 8, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t j = u / per_bucket;
      const int64_t start = (u % per_bucket) * block;
      const int64_t len = std::min(b, n - j * b) - start;
      if (len > 0) sums[u] = TreeSumOfSquares(x + j * b + start, std::min(len, block), block);
    }
  });
  for (int64_t j = 0; j < buckets; ++j) {
    double* s = sums.data() + j * per_bucket;
    for (int64_t w = per_bucket / 2; w >= 1; w /= 2) {
      for (int64_t t = 0; t < w; ++t) s[t] = s[2 * t] + s[2 * t + 1];
    }
    norms[j] = tfs::NormFromSumOfSquares(s[0]);
  }
}

// q[0:len] for x[0:len], whose first flat index is `first`, all in one bucket.
template <typename T, typename Q>
__attribute__((target_clones("avx2", "default"))) void QuantizeRun(const T* __restrict__ x, int64_t len, int64_t first, float norm, float levels,
                 int64_t seed, Q* __restrict__ q) {
  const uint32_t base = static_cast<uint32_t>(first);
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t index = base + static_cast<uint32_t>(j);
    q[j] = static_cast<Q>(tfs::QuantizeOne(Input(x[j]), norm, levels, tfs::HashUniform(seed, index)));
  }
}

template <typename T, typename Q>
class QsgdQuantizeCpuOp : public QsgdOpKernel {
 public:
  explicit QsgdQuantizeCpuOp(OpKernelConstruction* ctx)
      : QsgdOpKernel(ctx, "QSGDQuantize", DataTypeToEnum<Q>::value) {}

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& input = ctx->input(0);
    const Tensor& seed_t = ctx->input(1);
    OP_REQUIRES_OK(ctx, ValidateQsgdSeed(seed_t));
    const int64_t n = input.NumElements();
    const int64_t buckets = tfs::NumBuckets(n, bucket_size_);
    Tensor* levels_out = nullptr;
    Tensor* norms_out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({n}), &levels_out));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({buckets}), &norms_out));
    if (n == 0) return;
    const T* x = input.flat<T>().data();
    float* norms = norms_out->flat<float>().data();
    Q* q = levels_out->flat<Q>().data();
    BucketNorms(ctx, x, n, bucket_size_, norms);
    const int64_t b = tfs::EffectiveBucket(n, bucket_size_);
    const int64_t seed = seed_t.scalar<int64_t>()();
    const float levels = static_cast<float>(levels_);
    Parallel(ctx, n, 30, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end;) {
        const int64_t j = i / b;
        const int64_t stop = std::min(end, (j + 1) * b);
        const float norm = norms[j];
        QuantizeRun(x + i, stop - i, i, norm, levels, seed, q + i);
        i = stop;
      }
    });
  }
};

// out[0:len] = T(q * scale) clamped to +-top, for one bucket's run. float16 is converted by
// F16C where the CPU has it, from blocks of float32 results.
template <typename Q, typename T>
void DequantizeRun(const Q* q, int64_t len, float scale, float top, T* out) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, Eigen::half>) {
    if (HasF16c()) {
      float block[kHalfBlock];
      for (int64_t j = 0; j < len; j += kHalfBlock) {
        const int64_t width = std::min(kHalfBlock, len - j);
        for (int64_t e = 0; e < width; ++e) block[e] = tfs::DequantizeOne(q[j + e], scale, top);
        FloatsToHalfF16c(block, width, out + j);
      }
      return;
    }
  }
#endif
  for (int64_t j = 0; j < len; ++j) out[j] = static_cast<T>(tfs::DequantizeOne(q[j], scale, top));
}

template <typename Q, typename T>
class QsgdDequantizeCpuOp : public QsgdOpKernel {
 public:
  explicit QsgdDequantizeCpuOp(OpKernelConstruction* ctx)
      : QsgdOpKernel(ctx, "QSGDDequantize", DataTypeToEnum<Q>::value) {}

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& levels_in = ctx->input(0);
    const Tensor& norms_in = ctx->input(1);
    TensorShape shape;
    OP_REQUIRES_OK(ctx, ValidateDequantize(levels_in, norms_in, ctx->input(2), bucket_size_,
                                           &shape));
    Tensor* out_t = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &out_t));
    const int64_t n = levels_in.NumElements();
    if (n == 0) return;
    const Q* q = levels_in.flat<Q>().data();
    const float* norms = norms_in.flat<float>().data();
    T* out = out_t->flat<T>().data();
    const int64_t b = tfs::EffectiveBucket(n, bucket_size_);
    const float levels = static_cast<float>(levels_);
    const float top = std::is_same_v<T, Eigen::half>       ? tfs::kHalfMax
                      : std::is_same_v<T, Eigen::bfloat16> ? tfs::kBfloat16Max
                                                           : FLT_MAX;
    Parallel(ctx, n, 5, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end;) {
        const int64_t j = i / b;
        const int64_t stop = std::min(end, (j + 1) * b);
        DequantizeRun(q + i, stop - i, tfs::DequantizeScale(norms[j], levels), top, out + i);
        i = stop;
      }
    });
  }
};

#define TFS_REGISTER_QSGD_CPU(T, Q)                                                      \
  REGISTER_KERNEL_BUILDER(                                                               \
      Name("QSGDQuantize").Device(DEVICE_CPU).TypeConstraint<T>("T").TypeConstraint<Q>( \
          "out_type"),                                                                   \
      QsgdQuantizeCpuOp<T, Q>);                                                          \
  REGISTER_KERNEL_BUILDER(Name("QSGDDequantize")                                         \
                              .Device(DEVICE_CPU)                                        \
                              .TypeConstraint<Q>("Tq")                                   \
                              .TypeConstraint<T>("dtype"),                               \
                          QsgdDequantizeCpuOp<Q, T>);
#define TFS_REGISTER_QSGD_CPU_ALL(T) \
  TFS_REGISTER_QSGD_CPU(T, int8_t)   \
  TFS_REGISTER_QSGD_CPU(T, int16_t)

TFS_REGISTER_QSGD_CPU_ALL(Eigen::half)
TFS_REGISTER_QSGD_CPU_ALL(Eigen::bfloat16)
TFS_REGISTER_QSGD_CPU_ALL(float)
TFS_REGISTER_QSGD_CPU_ALL(double)

#undef TFS_REGISTER_QSGD_CPU_ALL
#undef TFS_REGISTER_QSGD_CPU

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
