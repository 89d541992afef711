// CPU kernel of TopKErrorFeedback: multi-threaded radix selection on magnitude keys.
//
// The flat tensor is split into one contiguous chunk per worker thread; every pass uses the
// same chunks, so per-chunk counts from one pass give exact output offsets in a later one.
//   1. acc = grad + residual is written to new_residual while each chunk histograms the top
//      digit of its keys. The digit holding the k-th largest key defines a band [lo, hi]:
//      keys above it are selected, `need` more come from the band.
//   2. Until the band is resolved (need == 0, need == all of it, or a single key), either
//      its keys are gathered (when few) and the exact k-th key is found among them, or one
//      more read-only pass histograms the next digit inside the band.
//   3. A last pass emits, in ascending index order, keys above the band plus the first
//      `need` band members by index, and zeroes them in new_residual.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/threadpool.h"
#include "tfs_common.h"
#include "validate.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

constexpr int64_t kMinChunk = int64_t{1} << 15;
constexpr int64_t kMaxChunk = int64_t{1} << 31;  // keeps uint32 histogram counters exact
constexpr int64_t kBlock = 1024;                 // fused add + histogram step
constexpr int64_t kScan = 32;                    // vectorized "anything here?" test
constexpr int64_t kMinGather = int64_t{1} << 16;

template <typename T>
using KeyT = typename tfs::KeyOf<sizeof(T)>::Bits;

template <typename T>
inline KeyT<T> KeyAt(const T* p) {
  KeyT<T> bits;
  std::memcpy(&bits, p, sizeof(T));
  return tfs::KeyOf<sizeof(T)>::Key(bits);
}

// Fixed partition of [0, n) into `count` contiguous chunks.
struct Chunks {
  int64_t n;
  int64_t count;
  int64_t Begin(int64_t c) const { return n / count * c + std::min(c, n % count); }
  int64_t End(int64_t c) const { return Begin(c + 1); }
};

void ForEachChunk(OpKernelContext* ctx, int64_t count, const std::function<void(int64_t)>& fn) {
  if (count == 1) {
    fn(0);
    return;
  }
  ctx->device()->tensorflow_cpu_worker_threads()->workers->ParallelFor(
      count, thread::ThreadPool::SchedulingParams::Fixed(1), [&fn](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) fn(c);
      });
}

template <typename T>
void AddInto(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void AddInPlace(T* __restrict__ out, const T* __restrict__ a, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] += a[i];
}

// acc[b:e] = grad + residual (acc may be residual); histograms key >> shift into h0/h1
// (two copies halve store-to-load stalls on repeated bins) unless h0 is null.
template <typename T>
void AddAndHistogram(const T* grad, const T* residual, T* acc, int64_t b, int64_t e, int shift,
                     uint32_t* h0, uint32_t* h1) {
  for (int64_t i0 = b; i0 < e; i0 += kBlock) {
    const int64_t len = std::min(e - i0, kBlock);
    if (acc == residual) {
      AddInPlace(acc + i0, grad + i0, len);
    } else {
      AddInto(acc + i0, grad + i0, residual + i0, len);
    }
    if (h0 == nullptr) continue;
    int64_t i = i0;
    for (; i + 1 < i0 + len; i += 2) {
      ++h0[KeyAt(acc + i) >> shift];
      ++h1[KeyAt(acc + i + 1) >> shift];
    }
    if (i < i0 + len) ++h0[KeyAt(acc + i) >> shift];
  }
}

// Candidate band: keys in [lo, hi]; `need` of them are still to be selected. Per chunk,
// `above` counts keys > hi and `in` keys inside the band.
template <typename Key>
struct Band {
  Key lo;
  Key hi;
  int64_t need;
  std::vector<int64_t> above;
  std::vector<int64_t> in;

  int64_t InTotal() const {
    int64_t s = 0;
    for (int64_t v : in) s += v;
    return s;
  }
  bool Resolved() const { return need == 0 || lo == hi || need == InTotal(); }
};

// Narrows the band to the digit (bits [shift, shift + log2(bins)) of the key) that holds the
// need-th largest key, from per-chunk histograms spaced `stride` apart.
template <typename Key>
void PickDigit(const std::vector<uint32_t>& hist, int64_t stride, int64_t bins, int shift,
               Band<Key>* band) {
  const int64_t chunks = static_cast<int64_t>(band->in.size());
  std::vector<int64_t> total(bins, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t d = 0; d < bins; ++d) total[d] += hist[c * stride + d];
  }
  int64_t digit = bins - 1;
  int64_t above = 0;
  while (above + total[digit] < band->need) above += total[digit--];
  for (int64_t c = 0; c < chunks; ++c) {
    const uint32_t* h = hist.data() + c * stride;
    for (int64_t d = digit + 1; d < bins; ++d) band->above[c] += h[d];
    band->in[c] = h[digit];
  }
  band->need -= above;
  band->lo = static_cast<Key>(band->lo + (static_cast<Key>(digit) << shift));
  band->hi = static_cast<Key>(band->lo + ((static_cast<Key>(1) << shift) - 1));
}

// True when any key in [p, p + len) is >= lo (a loop the compiler vectorizes).
template <typename T>
inline bool AnyAtLeast(const T* p, int64_t len, KeyT<T> lo) {
  bool any = false;
  for (int64_t i = 0; i < len; ++i) any |= KeyAt(p + i) >= lo;
  return any;
}

template <typename T>
inline bool AnyInBand(const T* p, int64_t len, KeyT<T> lo, KeyT<T> span) {
  bool any = false;
  for (int64_t i = 0; i < len; ++i) any |= static_cast<KeyT<T>>(KeyAt(p + i) - lo) <= span;
  return any;
}

// Gathers the band's keys and resolves it to the single key of the need-th largest.
template <typename T>
void GatherAndResolve(OpKernelContext* ctx, const T* acc, const Chunks& chunks,
                      Band<KeyT<T>>* band) {
  using Key = KeyT<T>;
  std::vector<int64_t> offset(chunks.count + 1, 0);
  for (int64_t c = 0; c < chunks.count; ++c) offset[c + 1] = offset[c] + band->in[c];
  std::vector<Key> keys(offset[chunks.count]);
  const Key lo = band->lo;
  const Key span = static_cast<Key>(band->hi - band->lo);
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    Key* out = keys.data() + offset[c];
    const int64_t e = chunks.End(c);
    for (int64_t i0 = chunks.Begin(c); i0 < e; i0 += kScan) {
      const int64_t i1 = std::min(e, i0 + kScan);
      if (!AnyInBand(acc + i0, i1 - i0, lo, span)) continue;
      for (int64_t i = i0; i < i1; ++i) {
        const Key key = KeyAt(acc + i);
        if (static_cast<Key>(key - lo) <= span) *out++ = key;
      }
    }
  });
  std::vector<Key> order(keys);
  std::nth_element(order.begin(), order.begin() + (band->need - 1), order.end(),
                   std::greater<Key>());
  const Key kth = order[band->need - 1];
  for (int64_t c = 0; c < chunks.count; ++c) {
    int64_t greater = 0;
    int64_t equal = 0;
    for (int64_t j = offset[c]; j < offset[c + 1]; ++j) {
      greater += keys[j] > kth;
      equal += keys[j] == kth;
    }
    band->above[c] += greater;
    band->in[c] = equal;
    band->need -= greater;
  }
  band->lo = band->hi = kth;
}

template <typename T, typename Index>
void TopKErrorFeedbackCpu(OpKernelContext* ctx, const T* grad, const T* residual, T* acc,
                          int64_t n, int64_t k, T* values, Index* indices) {
  using Key = KeyT<T>;
  constexpr int kKeyBits = tfs::KeyOf<sizeof(T)>::kBits;
  const int64_t threads =
      std::max(1, ctx->device()->tensorflow_cpu_worker_threads()->num_threads);
  Chunks chunks{n, std::clamp<int64_t>(n / kMinChunk, 1, threads)};
  chunks.count = std::max(chunks.count, (n + kMaxChunk - 1) / kMaxChunk);

  if (k == 0) {
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      AddAndHistogram(grad, residual, acc, chunks.Begin(c), chunks.End(c), 0, nullptr, nullptr);
    });
    return;
  }

  // Pass 1: fused add and top-digit histogram (16-bit keys are histogrammed whole).
  const int width0 = kKeyBits <= 16 ? kKeyBits : tfs::kDigitBits;
  int shift = kKeyBits - width0;
  int64_t bins = int64_t{1} << width0;
  std::vector<uint32_t> hist(chunks.count * 2 * bins, 0);
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    uint32_t* h = hist.data() + c * 2 * bins;
    AddAndHistogram(grad, residual, acc, chunks.Begin(c), chunks.End(c), shift, h, h + bins);
    for (int64_t d = 0; d < bins; ++d) h[d] += h[bins + d];
  });
  Band<Key> band{0, 0, k, std::vector<int64_t>(chunks.count, 0),
                 std::vector<int64_t>(chunks.count, 0)};
  PickDigit(hist, 2 * bins, bins, shift, &band);

  // Pass 2: narrow the band until the final rule is exact.
  const int64_t gather_limit = std::max(kMinGather, n / 16);
  while (!band.Resolved()) {
    if (band.InTotal() <= gather_limit) {
      GatherAndResolve(ctx, acc, chunks, &band);
      break;
    }
    const int next = std::max(shift - tfs::kDigitBits, 0);
    bins = int64_t{1} << (shift - next);
    const Key mask = static_cast<Key>(bins - 1);
    hist.assign(chunks.count * bins, 0);
    const Key lo = band.lo;
    const Key span = static_cast<Key>(band.hi - band.lo);
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      uint32_t* h = hist.data() + c * bins;
      for (int64_t i = chunks.Begin(c), e = chunks.End(c); i < e; ++i) {
        const Key key = KeyAt(acc + i);
        if (static_cast<Key>(key - lo) <= span) ++h[(key >> next) & mask];
      }
    });
    shift = next;
    PickDigit(hist, bins, bins, shift, &band);
  }

  // Pass 3: emit keys above the band and the first `quota` band members of each chunk.
  std::vector<int64_t> offset(chunks.count, 0);
  std::vector<int64_t> quota(chunks.count, 0);
  int64_t before_in = 0;
  int64_t out = 0;
  for (int64_t c = 0; c < chunks.count; ++c) {
    quota[c] = std::clamp<int64_t>(band.need - before_in, 0, band.in[c]);
    before_in += band.in[c];
    offset[c] = out;
    out += band.above[c] + quota[c];
  }
  const Key lo = band.lo;
  const Key hi = band.hi;
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    int64_t o = offset[c];
    int64_t taken = 0;
    const int64_t e = chunks.End(c);
    for (int64_t i0 = chunks.Begin(c); i0 < e; i0 += kScan) {
      const int64_t i1 = std::min(e, i0 + kScan);
      if (!AnyAtLeast(acc + i0, i1 - i0, lo)) continue;
      for (int64_t i = i0; i < i1; ++i) {
        const Key key = KeyAt(acc + i);
        if (key > hi || (key >= lo && taken < quota[c])) {
          taken += key <= hi;
          indices[o] = static_cast<Index>(i);
          values[o] = acc[i];
          acc[i] = T(0);
          ++o;
        }
      }
    }
  });
}

template <typename T, typename Index>
class TopKErrorFeedbackCpuOp : public OpKernel {
 public:
  explicit TopKErrorFeedbackCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    int64_t k = 0;
    OP_REQUIRES_OK(ctx, ValidateTopK(grad, residual, ctx->input(2),
                                     DataTypeToEnum<Index>::value, &k));
    Tensor* values = nullptr;
    Tensor* indices = nullptr;
    Tensor* new_residual = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({k}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({k}), &indices));
    OP_REQUIRES_OK(ctx,
                   ctx->forward_input_or_allocate_output({1}, 2, grad.shape(), &new_residual));
    const int64_t n = grad.NumElements();
    if (n == 0) return;
    TopKErrorFeedbackCpu<T, Index>(ctx, grad.flat<T>().data(), residual.flat<T>().data(),
                                   new_residual->flat<T>().data(), n, k,
                                   values->flat<T>().data(), indices->flat<Index>().data());
  }
};

#define TFS_REGISTER_TOPK_CPU(T, Index)                                \
  REGISTER_KERNEL_BUILDER(Name("TopKErrorFeedback")                    \
                              .Device(DEVICE_CPU)                      \
                              .TypeConstraint<T>("T")                  \
                              .TypeConstraint<Index>("index_type"),    \
                          TopKErrorFeedbackCpuOp<T, Index>);
#define TFS_REGISTER_TOPK_CPU_ALL(T) \
  TFS_REGISTER_TOPK_CPU(T, int32_t)  \
  TFS_REGISTER_TOPK_CPU(T, int64_t)

TFS_REGISTER_TOPK_CPU_ALL(Eigen::half)
TFS_REGISTER_TOPK_CPU_ALL(Eigen::bfloat16)
TFS_REGISTER_TOPK_CPU_ALL(float)
TFS_REGISTER_TOPK_CPU_ALL(double)

#undef TFS_REGISTER_TOPK_CPU_ALL
#undef TFS_REGISTER_TOPK_CPU

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
