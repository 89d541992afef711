// CPU kernel of TopKErrorFeedback: multi-threaded selection on magnitude keys.
//
// The flat tensor is split into one contiguous chunk per worker thread; every pass uses the
// same chunks, so per-chunk counts give exact output offsets and ascending output order.
//
// Fast path (k <= n / 8): the k-th largest key is estimated from samples of grad + residual;
// one fused pass writes acc = grad + residual to new_residual and gathers the (index, value)
// of every entry whose key reaches the estimate, histogramming their top key digit. When that
// set holds at least k entries it contains the whole top k, and the selection below runs on
// it alone: one pass over memory in all. Otherwise (or when k > n / 8) the same selection runs
// on the whole of acc, from a top-digit histogram taken with the add (or after it).
//
// Selection (radix on a "source", the gathered sets or all of acc): the digit holding the k-th
// largest key defines a band [lo, hi]; keys above it are selected and `need` more come from
// the band. Until the band is resolved (need == 0, need == all of it, or a single key) either
// its keys are gathered (when few) and the exact k-th key found among them, or the next digit
// inside the band is histogrammed. A last scan emits, in ascending index order, keys above the
// band and the first `need` band members by index, and zeroes them in new_residual.
//
// Everything runs under DAZ/FTZ (ScopedFlushDenormal), the ops' denormal policy: acc reads
// denormal inputs as zero and holds no denormals.
#define EIGEN_USE_THREADS

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/register_types.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/denormal.h"
#include "tensorflow/core/platform/threadpool.h"
#include "cpu_parallel.h"
#include "f16c.h"
#include "tfs_common.h"
#include "validate.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

constexpr int64_t kMinChunk = int64_t{1} << 15;
constexpr int64_t kMaxChunk = int64_t{1} << 31;  // keeps uint32 histogram counters exact
constexpr int64_t kBlock = 1024;                 // fused add + histogram step
constexpr int64_t kScan = 16;                    // vectorized "anything here?" test
constexpr int64_t kMinGather = int64_t{1} << 16;   // dense bands this small are gathered
constexpr int64_t kSmallGather = int64_t{1} << 12;  // so are bands of gathered entries
constexpr int64_t kMinSampled = int64_t{1} << 16;   // smallest n for the sampled fast path
constexpr int64_t kMaxSamples = int64_t{1} << 15;
constexpr int64_t kSampleRun = 16;  // consecutive samples (a cache line of float32)
constexpr int64_t kMinOwnThreads = int64_t{1} << 20;  // packed tensors this big use all threads
constexpr int64_t kPerTensorCost = 2048;  // a packed tensor's fixed work, in entries

template <typename T>
using KeyT = typename tfs::KeyOf<sizeof(T)>::Bits;

template <typename T>
inline KeyT<T> KeyAt(const T* p) {
  KeyT<T> bits;
  std::memcpy(&bits, p, sizeof(T));
  return tfs::KeyOf<sizeof(T)>::Key(bits);
}

template <typename T>
void AddInto(T* __restrict__ out, const T* __restrict__ a, const T* __restrict__ b, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] = a[i] + b[i];
}

template <typename T>
void AddInPlace(T* __restrict__ out, const T* __restrict__ a, int64_t len) {
  for (int64_t i = 0; i < len; ++i) out[i] += a[i];
}

#if defined(__x86_64__)
// float16 add through F16C conversions (round to nearest even, like Eigen's software path).
__attribute__((target("avx,f16c"))) void AddHalfF16c(const Eigen::half* a, const Eigen::half* b,
                                                       Eigen::half* out, int64_t len) {
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i)));
    const __m256 y = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_add_ps(x, y), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < len; ++i) out[i] = a[i] + b[i];
}
#endif

// acc[b:e] = grad + residual (acc may be residual or grad).
template <typename T>
void Add(const T* grad, const T* residual, T* acc, int64_t b, int64_t e) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<T, Eigen::half>) {
    if (HasF16c()) {
      AddHalfF16c(grad + b, residual + b, acc + b, e - b);
      return;
    }
  }
#endif
  if (acc == residual) {
    AddInPlace(acc + b, grad + b, e - b);
  } else if (acc == grad) {
    AddInPlace(acc + b, residual + b, e - b);
  } else {
    AddInto(acc + b, grad + b, residual + b, e - b);
  }
}

// Histograms key >> shift of acc[b:e] into h0/h1 (two copies halve store-to-load stalls on
// repeated bins).
template <typename T>
void Histogram(const T* acc, int64_t b, int64_t e, int shift, uint32_t* h0, uint32_t* h1) {
  int64_t i = b;
  for (; i + 1 < e; i += 2) {
    ++h0[KeyAt(acc + i) >> shift];
    ++h1[KeyAt(acc + i + 1) >> shift];
  }
  if (i < e) ++h0[KeyAt(acc + i) >> shift];
}

// Add and Histogram fused block by block (the block is still in L1 when histogrammed).
template <typename T>
void AddAndHistogram(const T* grad, const T* residual, T* acc, int64_t b, int64_t e, int shift,
                     uint32_t* h0, uint32_t* h1) {
  for (int64_t i0 = b; i0 < e; i0 += kBlock) {
    const int64_t i1 = std::min(e, i0 + kBlock);
    Add(grad, residual, acc, i0, i1);
    Histogram(acc, i0, i1, shift, h0, h1);
  }
}

// Bit j (j < kScan) is set when lo <= key(p[j]) <= hi.
template <typename T>
inline uint32_t BandMask(const T* p, KeyT<T> lo, KeyT<T> hi) {
#if defined(__SSE4_2__)
  // Keys fit the signed lanes; lo - 1 >= -1 and "not above hi" avoid overflow at the ends.
  constexpr int kVectors = kScan * sizeof(T) / 16;
  __m128i in[kVectors];
  for (int v = 0; v < kVectors; ++v) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + v);
    if constexpr (sizeof(T) == 2) {
      const __m128i key = _mm_and_si128(bits, _mm_set1_epi16(0x7FFF));
      in[v] = _mm_andnot_si128(_mm_cmpgt_epi16(key, _mm_set1_epi16(static_cast<int16_t>(hi))),
                               _mm_cmpgt_epi16(key, _mm_set1_epi16(static_cast<int16_t>(lo - 1))));
    } else if constexpr (sizeof(T) == 4) {
      const __m128i key = _mm_and_si128(bits, _mm_set1_epi32(0x7FFFFFFF));
      in[v] = _mm_andnot_si128(_mm_cmpgt_epi32(key, _mm_set1_epi32(static_cast<int32_t>(hi))),
                               _mm_cmpgt_epi32(key, _mm_set1_epi32(static_cast<int32_t>(lo) - 1)));
    } else {
      const __m128i key = _mm_and_si128(bits, _mm_set1_epi64x(0x7FFFFFFFFFFFFFFFll));
      in[v] = _mm_andnot_si128(
          _mm_cmpgt_epi64(key, _mm_set1_epi64x(static_cast<int64_t>(hi))),
          _mm_cmpgt_epi64(key, _mm_set1_epi64x(static_cast<int64_t>(lo) - 1)));
    }
  }
  uint32_t mask = 0;
  if constexpr (sizeof(T) == 2) {
    mask = static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(in[0], in[1])));
  } else if constexpr (sizeof(T) == 4) {
    for (int v = 0; v < kVectors; ++v) {
      mask |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(in[v]))) << (4 * v);
    }
  } else {
    for (int v = 0; v < kVectors; ++v) {
      mask |= static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(in[v]))) << (2 * v);
    }
  }
  return mask;
#else
  uint32_t mask = 0;
  for (int64_t j = 0; j < kScan; ++j) {
    const KeyT<T> key = KeyAt(p + j);
    mask |= static_cast<uint32_t>(key >= lo && key <= hi) << j;
  }
  return mask;
#endif
}

// Calls f(i) for every i in [b, e), ascending, whose key lies in [lo, hi].
template <typename T, typename F>
inline void ForEachInBand(const T* acc, int64_t b, int64_t e, KeyT<T> lo, KeyT<T> hi, F&& f) {
  int64_t i0 = b;
  for (; i0 + kScan <= e; i0 += kScan) {
    for (uint32_t m = BandMask(acc + i0, lo, hi); m != 0; m &= m - 1) {
      f(i0 + __builtin_ctz(m));
    }
  }
  for (; i0 < e; ++i0) {
    const KeyT<T> key = KeyAt(acc + i0);
    if (key >= lo && key <= hi) f(i0);
  }
}

template <typename T>
constexpr KeyT<T> kMaxKey = static_cast<KeyT<T>>(
    (KeyT<T>{1} << (tfs::KeyOf<sizeof(T)>::kBits - 1) << 1) - 1);

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

// Source of the whole of acc: Scan(c, lo, hi, f) calls f(index, key, value) for the entries
// of chunk c with key in [lo, hi], in ascending index order.
template <typename T>
struct DenseSource {
  const T* acc;
  const Chunks& chunks;

  template <bool kPrefetch, typename F>
  void Scan(int64_t c, KeyT<T> lo, KeyT<T> hi, F&& f) const {
    ForEachInBand(acc, chunks.Begin(c), chunks.End(c), lo, hi,
                  [&](int64_t i) { f(i, KeyAt(acc + i), acc[i]); });
  }
};

// Entries of one chunk whose key reached the estimated threshold, in index order.
template <typename T>
struct Candidates {
  std::unique_ptr<uint32_t[]> offset;  // index - chunk begin
  std::unique_ptr<T[]> value;
  int64_t capacity = 0;
  int64_t count = 0;
  bool overflow = false;
};

// Source of the gathered entries; kPrefetch prefetches acc at indices ahead (for zeroing).
template <typename T>
struct SparseSource {
  const std::vector<Candidates<T>>& cand;
  const Chunks& chunks;
  const T* acc;

  template <bool kPrefetch, typename F>
  void Scan(int64_t c, KeyT<T> lo, KeyT<T> hi, F&& f) const {
    constexpr int64_t kAhead = 16;
    const Candidates<T>& cc = cand[c];
    const T* base = acc + chunks.Begin(c);
    for (int64_t j = 0; j < cc.count; ++j) {
      if (kPrefetch && j + kAhead < cc.count) __builtin_prefetch(base + cc.offset[j + kAhead], 1);
      const KeyT<T> key = KeyAt(&cc.value[j]);
      if (key >= lo && key <= hi) f(chunks.Begin(c) + cc.offset[j], key, cc.value[j]);
    }
  }
};

// Gathers the band's keys and resolves it to the single key of the need-th largest.
template <typename T, typename Source>
void GatherAndResolve(OpKernelContext* ctx, const Source& src, Band<KeyT<T>>* band) {
  using Key = KeyT<T>;
  const int64_t chunks = static_cast<int64_t>(band->in.size());
  std::vector<int64_t> offset(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) offset[c + 1] = offset[c] + band->in[c];
  std::vector<Key> keys(offset[chunks]);
  ForEachChunk(ctx, chunks, [&](int64_t c) {
    Key* out = keys.data() + offset[c];
    src.template Scan<false>(c, band->lo, band->hi, [&](int64_t, Key key, T) { *out++ = key; });
  });
  std::vector<Key> order(keys);
  std::nth_element(order.begin(), order.begin() + (band->need - 1), order.end(),
                   std::greater<Key>());
  const Key kth = order[band->need - 1];
  for (int64_t c = 0; c < chunks; ++c) {
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

// Radix selection of the top k of `src` from per-chunk histograms (spaced `stride`) of its top
// digit at `shift`; writes values and indices and zeroes the selected entries of acc.
template <typename T, typename Index, typename Source>
void SelectFrom(OpKernelContext* ctx, const Source& src, int64_t gather_limit,
                std::vector<uint32_t>& hist, int64_t stride, int64_t bins, int shift, int64_t k,
                T* acc, T* values, Index* indices) {
  using Key = KeyT<T>;
  const int64_t chunks = static_cast<int64_t>(hist.size() / stride);
  Band<Key> band{0, 0, k, std::vector<int64_t>(chunks, 0), std::vector<int64_t>(chunks, 0)};
  PickDigit(hist, stride, bins, shift, &band);
  while (!band.Resolved()) {
    if (band.InTotal() <= gather_limit) {
      GatherAndResolve<T>(ctx, src, &band);
      break;
    }
    const int next = std::max(shift - tfs::kDigitBits, 0);
    bins = int64_t{1} << (shift - next);
    const Key mask = static_cast<Key>(bins - 1);
    hist.assign(chunks * bins, 0);
    ForEachChunk(ctx, chunks, [&](int64_t c) {
      uint32_t* h = hist.data() + c * bins;
      src.template Scan<false>(c, band.lo, band.hi,
                               [&](int64_t, Key key, T) { ++h[(key >> next) & mask]; });
    });
    shift = next;
    PickDigit(hist, bins, bins, shift, &band);
  }

  std::vector<int64_t> offset(chunks, 0);
  std::vector<int64_t> quota(chunks, 0);
  int64_t before_in = 0;
  int64_t out = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    quota[c] = std::clamp<int64_t>(band.need - before_in, 0, band.in[c]);
    before_in += band.in[c];
    offset[c] = out;
    out += band.above[c] + quota[c];
  }
  const Key hi = band.hi;
  ForEachChunk(ctx, chunks, [&](int64_t c) {
    int64_t o = offset[c];
    int64_t taken = 0;
    src.template Scan<true>(c, band.lo, kMaxKey<T>, [&](int64_t i, Key key, T value) {
      if (key > hi || taken < quota[c]) {
        taken += key <= hi;
        indices[o] = static_cast<Index>(i);
        values[o] = value;
        acc[i] = T(0);
        ++o;
      }
    });
  });
}

// Estimates a key threshold with about k * (1 + 4 / sqrt(k_s)) + 8 n / n_s entries at or above
// it from n_s samples of grad + residual, taken in runs of kSampleRun (k_s = k n_s / n is the
// expected number of samples above the k-th key). Returns false when the estimate is useless
// (it would take nearly everything, or key 0).
template <typename T>
bool EstimateThreshold(OpKernelContext* ctx, const T* grad, const T* residual,
                       const Chunks& chunks, int64_t k, KeyT<T>* lo, int64_t* expected) {
  const int64_t n = chunks.n;
  const int64_t runs = std::clamp<int64_t>(n / 64, 4096, kMaxSamples) / kSampleRun;
  const int64_t samples = runs * kSampleRun;
  const double per_sample = static_cast<double>(k) * samples / n;
  const int64_t rank = static_cast<int64_t>(per_sample + 4.0 * std::sqrt(per_sample) + 8.0);
  if (rank >= samples / 2) return false;
  std::vector<KeyT<T>> keys(samples);
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    constexpr int64_t kAhead = 8;
    const int64_t step = (n - kSampleRun) / runs;
    const int64_t last = runs * (c + 1) / chunks.count;
    for (int64_t run = runs * c / chunks.count; run < last; ++run) {
      const int64_t i0 = step * run;
      if (run + kAhead < last) {
        __builtin_prefetch(grad + i0 + kAhead * step);
        __builtin_prefetch(residual + i0 + kAhead * step);
      }
      for (int64_t j = 0; j < kSampleRun; ++j) {
        const T a = grad[i0 + j] + residual[i0 + j];
        keys[run * kSampleRun + j] = KeyAt(&a);
      }
    }
  });
  std::nth_element(keys.begin(), keys.begin() + rank, keys.end(), std::greater<KeyT<T>>());
  *lo = keys[rank];
  *expected = (rank + 1) * n / samples;
  return *lo > 0;
}

// acc[b:e] = grad + residual, gathering entries with key >= lo into `out` and histogramming
// their key >> shift into `hist`.
template <typename T>
void AddAndCollect(const T* grad, const T* residual, T* acc, int64_t b, int64_t e, KeyT<T> lo,
                   int shift, uint32_t* hist, Candidates<T>* out) {
  uint32_t* offset = out->offset.get();
  T* value = out->value.get();
  const int64_t capacity = out->capacity;
  int64_t count = 0;
  auto record = [&](int64_t i) {
    if (count < capacity) {
      offset[count] = static_cast<uint32_t>(i - b);
      value[count] = acc[i];
      ++hist[KeyAt(acc + i) >> shift];
    }
    ++count;
  };
  int64_t i0 = b;
#if defined(__SSE4_2__)
  if constexpr (std::is_same_v<T, float>) {
    // Fused: add four vectors, store them and test their keys against lo in one go.
    const __m128i sign_off = _mm_set1_epi32(0x7FFFFFFF);
    const __m128i below = _mm_set1_epi32(static_cast<int32_t>(lo) - 1);
    for (; i0 + kScan <= e; i0 += kScan) {
      uint32_t m = 0;
      for (int v = 0; v < 4; ++v) {
        const __m128 sum =
            _mm_add_ps(_mm_loadu_ps(grad + i0 + 4 * v), _mm_loadu_ps(residual + i0 + 4 * v));
        _mm_storeu_ps(acc + i0 + 4 * v, sum);
        const __m128i key = _mm_and_si128(_mm_castps_si128(sum), sign_off);
        m |= static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpgt_epi32(key, below))))
             << (4 * v);
      }
      for (; m != 0; m &= m - 1) record(i0 + __builtin_ctz(m));
    }
  }
#endif
  for (; i0 < e; i0 += kBlock) {
    const int64_t i1 = std::min(e, i0 + kBlock);
    Add(grad, residual, acc, i0, i1);
    ForEachInBand(acc, i0, i1, lo, kMaxKey<T>, record);
  }
  out->overflow = count > capacity;
  out->count = std::min(count, capacity);
}

// The fast path: fused add and gather of keys >= lo (about `expected` of them), then selection
// among the gathered entries. Returns false (acc written, nothing selected) when the gathered
// set may miss part of the top k.
template <typename T, typename Index>
bool SampledSelect(OpKernelContext* ctx, const T* grad, const T* residual, T* acc,
                   const Chunks& chunks, int64_t k, KeyT<T> lo, int64_t expected, T* values,
                   Index* indices) {
  constexpr int kKeyBits = tfs::KeyOf<sizeof(T)>::kBits;
  const int width = std::min(kKeyBits, tfs::kDigitBits);
  const int shift = kKeyBits - width;
  const int64_t bins = int64_t{1} << width;
  std::vector<Candidates<T>> cand(chunks.count);
  std::vector<uint32_t> hist(chunks.count * bins, 0);
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    const int64_t b = chunks.Begin(c);
    const int64_t e = chunks.End(c);
    Candidates<T>& cc = cand[c];
    cc.capacity = std::min(e - b, 2 * expected + 4096);
    cc.offset.reset(new uint32_t[cc.capacity]);
    cc.value.reset(new T[cc.capacity]);
    AddAndCollect(grad, residual, acc, b, e, lo, shift, hist.data() + c * bins, &cc);
  });
  int64_t total = 0;
  for (const Candidates<T>& cc : cand) {
    if (cc.overflow) return false;
    total += cc.count;
  }
  if (total < k) return false;
  const SparseSource<T> src{cand, chunks, acc};
  SelectFrom(ctx, src, kSmallGather, hist, bins, bins, shift, k, acc, values, indices);
  return true;
}

// The top k of grad + residual on up to `threads` threads (1: all in the caller's thread).
template <typename T, typename Index>
void TopKErrorFeedbackCpu(OpKernelContext* ctx, int64_t threads, const T* grad, const T* residual,
                          T* acc, int64_t n, int64_t k, T* values, Index* indices) {
  constexpr int kKeyBits = tfs::KeyOf<sizeof(T)>::kBits;
  Chunks chunks{n, std::clamp<int64_t>(n / kMinChunk, 1, threads)};
  chunks.count = std::max(chunks.count, (n + kMaxChunk - 1) / kMaxChunk);
  if (k == 0) {
    ForEachChunk(ctx, chunks.count,
                 [&](int64_t c) { Add(grad, residual, acc, chunks.Begin(c), chunks.End(c)); });
    return;
  }
  bool acc_written = false;
  KeyT<T> lo = 0;
  int64_t expected = 0;
  if (n >= kMinSampled && k <= n / 8 &&
      EstimateThreshold(ctx, grad, residual, chunks, k, &lo, &expected)) {
    if (SampledSelect(ctx, grad, residual, acc, chunks, k, lo, expected, values, indices)) {
      return;
    }
    acc_written = true;
  }
  // Top-digit histogram, fused with the add unless the sampled pass wrote acc (16-bit keys
  // are histogrammed whole).
  const int width = kKeyBits <= 16 ? kKeyBits : tfs::kDigitBits;
  const int shift = kKeyBits - width;
  const int64_t bins = int64_t{1} << width;
  std::vector<uint32_t> hist(chunks.count * 2 * bins, 0);
  ForEachChunk(ctx, chunks.count, [&](int64_t c) {
    uint32_t* h = hist.data() + c * 2 * bins;
    if (acc_written) {
      Histogram(acc, chunks.Begin(c), chunks.End(c), shift, h, h + bins);
    } else {
      AddAndHistogram(grad, residual, acc, chunks.Begin(c), chunks.End(c), shift, h, h + bins);
    }
    for (int64_t d = 0; d < bins; ++d) h[d] += h[bins + d];
  });
  const DenseSource<T> src{acc, chunks};
  SelectFrom(ctx, src, std::max(kMinGather, n / 16), hist, 2 * bins, bins, shift, k, acc, values,
             indices);
}

template <typename T, typename Index>
class TopKErrorFeedbackCpuOp : public OpKernel {
 public:
  explicit TopKErrorFeedbackCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& grad = ctx->input(0);
    const Tensor& residual = ctx->input(1);
    TopKOutputs out;
    // acc may take grad's buffer: every pass reads grad[i] before writing acc[i], and later
    // passes read acc only.
    OP_REQUIRES_OK(ctx, PrepareTopK(ctx, DataTypeToEnum<Index>::value, {0, 1}, &out));
    const int64_t n = grad.NumElements();
    if (n == 0) return;
    TopKErrorFeedbackCpu<T, Index>(ctx, WorkerThreads(ctx), grad.flat<T>().data(),
                                   residual.flat<T>().data(),
                                   out.new_residual->flat<T>().data(), n, out.k,
                                   out.values->flat<T>().data(),
                                   out.indices->flat<Index>().data());
  }
};

// TopKErrorFeedbackPacked: TopKErrorFeedback of N tensors in one launch (a bucket of many
// small tensors pays one op dispatch instead of N), each with its own k; values and indices
// are the tensors' outputs concatenated in input order (indices flat within their tensor).
// Tensors of kMinOwnThreads entries or more are selected one after another on all threads;
// the others run side by side, each whole on one thread (their outputs are disjoint slices,
// so the result does not depend on which thread took which tensor).
template <typename T, typename Index>
class TopKErrorFeedbackPackedCpuOp : public OpKernel {
 public:
  explicit TopKErrorFeedbackPackedCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("ks", &ks_));
  }

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    OpInputList grads, residuals;
    OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
    OP_REQUIRES_OK(ctx, ctx->input_list("residuals", &residuals));
    const int num = grads.size();
    OP_REQUIRES(ctx, static_cast<int>(ks_.size()) == num,
                absl::InvalidArgumentError(absl::StrCat(
                    "TopKErrorFeedbackPacked: ks must have one k per tensor (", num, "), got ",
                    ks_.size())));
    int64_t total = 0;
    for (int i = 0; i < num; ++i) {
      OP_REQUIRES(ctx, grads[i].shape() == residuals[i].shape(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "TopKErrorFeedbackPacked: residuals[", i, "] must have grads[", i,
                      "]'s shape ", grads[i].shape().DebugString(), ", got ",
                      residuals[i].shape().DebugString())));
      const int64_t n = grads[i].NumElements();
      OP_REQUIRES(ctx, ks_[i] >= 0 && ks_[i] <= n,
                  absl::InvalidArgumentError(absl::StrCat(
                      "TopKErrorFeedbackPacked: ks[", i, "] must be in [0, ", n,
                      "] (the number of elements of grads[", i, "]), got ", ks_[i])));
      OP_REQUIRES(ctx, n <= static_cast<int64_t>(std::numeric_limits<Index>::max()),
                  absl::InvalidArgumentError(absl::StrCat(
                      "TopKErrorFeedbackPacked: grads[", i, "] has ", n,
                      " elements, more than index_type can index")));
      total += ks_[i];
    }
    Tensor* values = nullptr;
    Tensor* indices = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({total}), &values));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({total}), &indices));
    std::vector<T*> accs(num);
    std::vector<int64_t> first(num + 1, 0);  // output offset of each tensor
    for (int i = 0; i < num; ++i) {
      Tensor* acc = nullptr;
      OP_REQUIRES_OK(ctx, ctx->forward_input_or_allocate_output({i, num + i}, 2 + i,
                                                                 grads[i].shape(), &acc));
      accs[i] = acc->flat<T>().data();
      first[i + 1] = first[i] + ks_[i];
    }
    const int64_t threads = WorkerThreads(ctx);
    auto select = [&](int i, int64_t on) {
      const int64_t n = grads[i].NumElements();
      if (n == 0) return;
      TopKErrorFeedbackCpu<T, Index>(ctx, on, grads[i].flat<T>().data(),
                                     residuals[i].flat<T>().data(), accs[i], n, ks_[i],
                                     values->flat<T>().data() + first[i],
                                     indices->flat<Index>().data() + first[i]);
    };
    std::vector<int> shared;  // tensors that run whole on one thread
    for (int i = 0; i < num; ++i) {
      if (grads[i].NumElements() >= kMinOwnThreads) {
        select(i, threads);
      } else {
        shared.push_back(i);
      }
    }
    const auto groups = LeastLoadedGroups(
        shared, threads, [&](int i) { return grads[i].NumElements() + kPerTensorCost; });
    if (!groups.empty()) {
      ForEachChunk(ctx, groups.size(), [&](int64_t g) {
        for (int i : groups[g]) select(i, 1);
      });
    }
  }

 private:
  std::vector<int64_t> ks_;
};

#define TFS_REGISTER_TOPK_PACKED_CPU(T, Index)                      \
  REGISTER_KERNEL_BUILDER(Name("TopKErrorFeedbackPacked")           \
                              .Device(DEVICE_CPU)                   \
                              .TypeConstraint<T>("T")               \
                              .TypeConstraint<Index>("index_type"), \
                          TopKErrorFeedbackPackedCpuOp<T, Index>);
#define TFS_REGISTER_TOPK_CPU_ALL(T)       \
  TFS_REGISTER_TOPK_PACKED_CPU(T, int32_t) \
  TFS_REGISTER_TOPK_PACKED_CPU(T, int64_t)

TFS_REGISTER_TOPK_CPU_ALL(Eigen::half)
TFS_REGISTER_TOPK_CPU_ALL(Eigen::bfloat16)
TFS_REGISTER_TOPK_CPU_ALL(float)
TFS_REGISTER_TOPK_CPU_ALL(double)

#undef TFS_REGISTER_TOPK_CPU_ALL
#undef TFS_REGISTER_TOPK_PACKED_CPU

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
