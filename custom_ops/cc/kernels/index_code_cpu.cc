// CPU kernels of IndexCodeEncode and IndexCodeDecode: the Elias-Fano code of k ascending
// distinct flat indices in [0, n), as TopK's payload carries them.
//
// Layout (bits little-endian within and across bytes): with L = low_bits and
// H = ((n - 1) >> L) + k, index j (value x) sets bit (x >> L) + j of the map (bits [0, H)) and
// puts x mod 2^L at bits [H + j * L, H + (j + 1) * L); every other bit is 0. The code has
// ceil((H + k * L) / 8) bytes (none when k = 0). Both kernels walk the code once: encode
// writes the low parts with a 64-bit bit writer, decode finds the map's ones word by word
// (count trailing zeros) and reads the low parts with a 64-bit bit reader. Rows of a gathered
// [..., bytes] code decode in parallel on TF's CPU pool. Bad input (unsorted, repeated or
// out-of-range indices; a code row that is not the code of k strictly ascending indices below
// n: its map does not hold exactly k ones, it decodes past n or to indices that do not
// ascend, or a padding bit is set) fails with InvalidArgument naming the argument, the row
// and the position.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/platform/denormal.h"
#include "cpu_parallel.h"
#include "tfs_common.h"

namespace tensorflow {
namespace tfs_ops {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the code is read as little-endian words");

// Bits of the map, low part width and code bytes for k of n indices (attrs checked by the op).
struct Layout {
  int64_t low_bits;
  int64_t map_bits;
  int64_t bytes;
};

Layout MakeLayout(int64_t n, int64_t k, int64_t low_bits) {
  return {low_bits, tfs::IndexCodeMapBits(n, k, low_bits), tfs::IndexCodeBytes(n, k, low_bits)};
}

absl::Status CheckAttrs(const char* op, int64_t n, int64_t low_bits) {
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": num_elements must be >= 0, got ", n));
  }
  if (low_bits < 0 || low_bits > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": low_bits must be in [0, 32], got ", low_bits));
  }
  return absl::OkStatus();
}

// Appends fields of at most 32 bits to a zeroed byte buffer, starting at bit `bit`.
class BitWriter {
 public:
  BitWriter(uint8_t* out, int64_t bit) : out_(out + (bit >> 3)), used_(bit & 7) {
    pending_ = used_ ? *out_ : 0;
  }
  void Put(uint64_t value, int width) {
    pending_ |= value << used_;
    used_ += width;
    while (used_ >= 8) {
      *out_++ = static_cast<uint8_t>(pending_);
      pending_ >>= 8;
      used_ -= 8;
    }
  }
  void Flush() {
    if (used_) *out_ = static_cast<uint8_t>(pending_);
  }

 private:
  uint8_t* out_;
  int used_;
  uint64_t pending_;
};

// Reads consecutive fields of at most 32 bits from `code` (of `size` bytes) from bit `bit`.
class BitReader {
 public:
  BitReader(const uint8_t* code, int64_t size, int64_t bit)
      : code_(code), size_(size), next_(bit >> 3), skip_(bit & 7) {}
  uint64_t Get(int width) {
    while (have_ < width + skip_) {
      const uint64_t byte = next_ < size_ ? code_[next_] : 0;
      buffer_ |= byte << have_;
      have_ += 8;
      ++next_;
    }
    buffer_ >>= skip_;
    have_ -= skip_;
    skip_ = 0;
    const uint64_t value = buffer_ & ((uint64_t{1} << width) - 1);
    buffer_ >>= width;
    have_ -= width;
    return value;
  }

 private:
  const uint8_t* code_;
  int64_t size_;
  int64_t next_;
  int skip_;
  uint64_t buffer_ = 0;
  int have_ = 0;
};

template <typename Index>
absl::Status CheckSorted(const Index* indices, int64_t k, int64_t n) {
  for (int64_t j = 0; j < k; ++j) {
    const int64_t x = static_cast<int64_t>(indices[j]);
    if (x < 0 || x >= n) {
      return absl::InvalidArgumentError(absl::StrCat(
          "IndexCodeEncode: indices[", j, "] = ", x, " is out of range [0, ", n, ")"));
    }
    if (j > 0 && x <= static_cast<int64_t>(indices[j - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("IndexCodeEncode: indices must be strictly ascending, got indices[", j - 1,
                       "] = ", static_cast<int64_t>(indices[j - 1]), " and indices[", j,
                       "] = ", x));
    }
  }
  return absl::OkStatus();
}

template <typename Index>
void Encode(const Index* indices, int64_t k, const Layout& layout, uint8_t* code) {
  std::memset(code, 0, layout.bytes);
  const int low = static_cast<int>(layout.low_bits);
  const uint64_t low_mask = (uint64_t{1} << low) - 1;
  for (int64_t j = 0; j < k; ++j) {
    const uint64_t bit = (static_cast<uint64_t>(indices[j]) >> low) + j;
    code[bit >> 3] |= static_cast<uint8_t>(1u << (bit & 7));
  }
  if (low == 0) return;
  BitWriter lows(code, layout.map_bits);  // after the map: it shares the map's last byte
  for (int64_t j = 0; j < k; ++j) lows.Put(static_cast<uint64_t>(indices[j]) & low_mask, low);
  lows.Flush();
}

template <typename Index>
class IndexCodeEncodeOp : public OpKernel {
 public:
  explicit IndexCodeEncodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_elements", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("low_bits", &low_bits_));
    OP_REQUIRES_OK(ctx, CheckAttrs("IndexCodeEncode", n_, low_bits_));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    OP_REQUIRES(ctx, TensorShapeUtils::IsVector(indices.shape()),
                absl::InvalidArgumentError(absl::StrCat(
                    "IndexCodeEncode: indices must be a vector, got shape ",
                    indices.shape().DebugString())));
    const int64_t k = indices.NumElements();
    const Index* idx = indices.flat<Index>().data();
    OP_REQUIRES_OK(ctx, CheckSorted(idx, k, n_));
    const Layout layout = MakeLayout(n_, k, low_bits_);
    Tensor* code = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({layout.bytes}), &code));
    if (k) Encode(idx, k, layout, code->flat<uint8_t>().data());
  }

 private:
  int64_t n_;
  int64_t low_bits_;
};

// Positions of the map's ones and the low parts of one row, as indices; an error names the row.
// A row is accepted only when it is the code of k strictly ascending indices below n, so that
// encoding them gives the row back: the map holds exactly k ones, each decoded index is above
// the previous one and below n, and the padding bits after the last low part are 0.
template <typename Index>
absl::Status DecodeRow(const uint8_t* code, int64_t row, int64_t k, int64_t n,
                       const Layout& layout, Index* out) {
  const int low = static_cast<int>(layout.low_bits);
  BitReader lows(code, layout.bytes, layout.map_bits);
  int64_t j = 0;
  int64_t previous = -1;
  for (int64_t base = 0; base < layout.map_bits; base += 64) {
    const int64_t len = std::min<int64_t>(8, (layout.map_bits - base + 7) / 8);
    uint64_t word = 0;
    std::memcpy(&word, code + (base >> 3), len);
    if (layout.map_bits - base < 64) word &= (uint64_t{1} << (layout.map_bits - base)) - 1;
    for (; word; word &= word - 1, ++j) {
      if (j == k) {
        return absl::InvalidArgumentError(absl::StrCat(
            "IndexCodeDecode: code row ", row, " is not a valid index code: its map holds more ",
            "than k = ", k, " ones (a stray one at bit ", base + __builtin_ctzll(word), ")"));
      }
      const int64_t high = base + __builtin_ctzll(word) - j;
      const int64_t x = (high << low) | static_cast<int64_t>(low ? lows.Get(low) : 0);
      if (x >= n) {
        return absl::InvalidArgumentError(absl::StrCat("IndexCodeDecode: code row ", row,
                                                       " decodes index ", j, " to ", x,
                                                       ", out of range [0, ", n, ")"));
      }
      if (x <= previous) {
        return absl::InvalidArgumentError(absl::StrCat(
            "IndexCodeDecode: code row ", row, " is not a valid index code: it decodes index ",
            j - 1, " to ", previous, " and index ", j, " to ", x, ", not strictly ascending"));
      }
      out[j] = static_cast<Index>(x);
      previous = x;
    }
  }
  if (j < k) {
    return absl::InvalidArgumentError(absl::StrCat("IndexCodeDecode: code row ", row,
                                                   " holds ", j, " indices, expected k = ", k));
  }
  const int64_t used = layout.map_bits + k * layout.low_bits;  // the rest of the last byte: 0
  if ((used & 7) && (code[layout.bytes - 1] >> (used & 7))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "IndexCodeDecode: code row ", row, " is not a valid index code: padding bits after bit ",
        used, " are not 0"));
  }
  return absl::OkStatus();
}

template <typename Index>
class IndexCodeDecodeOp : public OpKernel {
 public:
  explicit IndexCodeDecodeOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_elements", &n_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("k", &k_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("low_bits", &low_bits_));
    OP_REQUIRES_OK(ctx, CheckAttrs("IndexCodeDecode", n_, low_bits_));
    OP_REQUIRES(ctx, k_ >= 0 && k_ <= n_,
                absl::InvalidArgumentError(absl::StrCat(
                    "IndexCodeDecode: k must be in [0, ", n_, "], got k = ", k_)));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& code = ctx->input(0);
    const Layout layout = MakeLayout(n_, k_, low_bits_);
    OP_REQUIRES(ctx, code.dims() >= 1 && code.dim_size(code.dims() - 1) == layout.bytes,
                absl::InvalidArgumentError(absl::StrCat(
                    "IndexCodeDecode: code must have ", layout.bytes, " bytes on its last axis (k = ",
                    k_, " of ", n_, " indices), got shape ", code.shape().DebugString())));
    TensorShape shape = code.shape();
    shape.set_dim(shape.dims() - 1, k_);
    Tensor* indices = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, shape, &indices));
    const int64_t rows = layout.bytes ? code.NumElements() / layout.bytes : 0;
    if (rows == 0 || k_ == 0) return;
    const uint8_t* in = code.flat<uint8_t>().data();
    Index* out = indices->flat<Index>().data();
    std::vector<absl::Status> status(rows);
    const Chunks chunks{rows, std::min(rows, WorkerThreads(ctx))};
    ForEachChunk(ctx, chunks.count, [&](int64_t c) {
      for (int64_t r = chunks.Begin(c); r < chunks.End(c); ++r) {
        status[r] = DecodeRow(in + r * layout.bytes, r, k_, n_, layout, out + r * k_);
      }
    });
    for (const absl::Status& s : status) OP_REQUIRES_OK(ctx, s);
  }

 private:
  int64_t n_;
  int64_t k_;
  int64_t low_bits_;
};

// The per-tensor layouts of a packed bucket (attrs num_elements, ks, low_bits: one per tensor).
class PackedLayouts {
 public:
  absl::Status Read(OpKernelConstruction* ctx, const char* op) {
    TF_RETURN_IF_ERROR(ctx->GetAttr("ks", &ks_));
    TF_RETURN_IF_ERROR(ctx->GetAttr("low_bits", &low_bits_));
    if (ns_.empty()) TF_RETURN_IF_ERROR(ctx->GetAttr("num_elements", &ns_));
    if (ks_.size() != ns_.size() || low_bits_.size() != ns_.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": num_elements, ks and low_bits must have one entry per tensor, got ", ns_.size(),
          ", ", ks_.size(), " and ", low_bits_.size()));
    }
    for (size_t i = 0; i < ns_.size(); ++i) {
      TF_RETURN_IF_ERROR(CheckAttrs(op, ns_[i], low_bits_[i]));
      if (ks_[i] < 0 || ks_[i] > ns_[i]) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": ks[", i, "] must be in [0, ",
                                                       ns_[i], "], got ", ks_[i]));
      }
      layouts_.push_back(MakeLayout(ns_[i], ks_[i], low_bits_[i]));
      total_k_ += ks_[i];
      total_bytes_ += layouts_.back().bytes;
    }
    return absl::OkStatus();
  }
  void SetNumElements(std::vector<int64_t> ns) { ns_ = std::move(ns); }
  size_t size() const { return ns_.size(); }
  int64_t n(size_t i) const { return ns_[i]; }
  int64_t k(size_t i) const { return ks_[i]; }
  const Layout& layout(size_t i) const { return layouts_[i]; }
  int64_t total_k() const { return total_k_; }
  int64_t total_bytes() const { return total_bytes_; }

 private:
  std::vector<int64_t> ns_, ks_, low_bits_;
  std::vector<Layout> layouts_;
  int64_t total_k_ = 0;
  int64_t total_bytes_ = 0;
};

// IndexCodeEncodePacked: the codes of a packed bucket's index segments, concatenated.
template <typename Index>
class IndexCodeEncodePackedOp : public OpKernel {
 public:
  explicit IndexCodeEncodePackedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, layouts_.Read(ctx, "IndexCodeEncodePacked"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& indices = ctx->input(0);
    OP_REQUIRES(ctx,
                TensorShapeUtils::IsVector(indices.shape()) &&
                    indices.NumElements() == layouts_.total_k(),
                absl::InvalidArgumentError(absl::StrCat(
                    "IndexCodeEncodePacked: indices must be a vector of sum(ks) = ",
                    layouts_.total_k(), " entries, got shape ", indices.shape().DebugString())));
    Tensor* code = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({layouts_.total_bytes()}), &code));
    const Index* idx = indices.flat<Index>().data();
    uint8_t* out = code->flat<uint8_t>().data();
    for (size_t i = 0; i < layouts_.size(); ++i) {
      const int64_t k = layouts_.k(i);
      OP_REQUIRES_OK(ctx, CheckSorted(idx, k, layouts_.n(i)));
      if (k) Encode(idx, k, layouts_.layout(i), out);
      idx += k;
      out += layouts_.layout(i).bytes;
    }
  }

 private:
  PackedLayouts layouts_;
};

// IndexCodeDecodePacked: code [P, sum(bytes)] of IndexCodeEncodePacked's layout gives the
// [P, sum(ks)] indices, each segment's flat within its own tensor.
template <typename Index>
class IndexCodeDecodePackedOp : public OpKernel {
 public:
  explicit IndexCodeDecodePackedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, layouts_.Read(ctx, "IndexCodeDecodePacked"));
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& code = ctx->input(0);
    OP_REQUIRES(ctx, code.dims() == 2 && code.dim_size(1) == layouts_.total_bytes(),
                absl::InvalidArgumentError(absl::StrCat(
                    "IndexCodeDecodePacked: code must be [replicas, ", layouts_.total_bytes(),
                    "], got shape ", code.shape().DebugString())));
    const int64_t rows = code.dim_size(0);
    Tensor* indices = nullptr;
    OP_REQUIRES_OK(ctx,
                   ctx->allocate_output(0, TensorShape({rows, layouts_.total_k()}), &indices));
    const uint8_t* in = code.flat<uint8_t>().data();
    Index* out = indices->flat<Index>().data();
    for (int64_t r = 0; r < rows; ++r) {
      int64_t c_at = r * layouts_.total_bytes();
      Index* o = out + r * layouts_.total_k();
      for (size_t i = 0; i < layouts_.size(); ++i) {
        if (layouts_.k(i)) {
          OP_REQUIRES_OK(ctx, DecodeRow(in + c_at, r, layouts_.k(i), layouts_.n(i),
                                        layouts_.layout(i), o));
        }
        c_at += layouts_.layout(i).bytes;
        o += layouts_.k(i);
      }
    }
  }

 private:
  PackedLayouts layouts_;
};

// PackedDecompressSum: for gathered packed payloads (values [P, sum(ks)], codes
// [P, sum(bytes)]), each tensor's dense sum over the P rows times scale, in its shape. Rows add
// in order onto zeros with T's addition under DAZ/FTZ, as ScatterSum of the rows' entries does.
template <typename T>
class PackedDecompressSumOp : public OpKernel {
 public:
  explicit PackedDecompressSumOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shapes", &shapes_));
    std::vector<int64_t> ns;
    for (const PartialTensorShape& shape : shapes_) {
      OP_REQUIRES(ctx, shape.IsFullyDefined(),
                  absl::InvalidArgumentError(absl::StrCat(
                      "PackedDecompressSum: shapes must be fully defined, got ",
                      shape.DebugString())));
      ns.push_back(shape.num_elements());
    }
    layouts_.SetNumElements(std::move(ns));
    OP_REQUIRES_OK(ctx, layouts_.Read(ctx, "PackedDecompressSum"));
  }

  void Compute(OpKernelContext* ctx) override {
    port::ScopedFlushDenormal flush;
    const Tensor& values = ctx->input(0);
    const Tensor& code = ctx->input(1);
    const Tensor& scale_t = ctx->input(2);
    OP_REQUIRES(ctx, values.dims() == 2 && values.dim_size(1) == layouts_.total_k(),
                absl::InvalidArgumentError(absl::StrCat(
                    "PackedDecompressSum: values must be [replicas, ", layouts_.total_k(),
                    "], got shape ", values.shape().DebugString())));
    const int64_t rows = values.dim_size(0);
    OP_REQUIRES(ctx,
                code.dims() == 2 && code.dim_size(0) == rows &&
                    code.dim_size(1) == layouts_.total_bytes(),
                absl::InvalidArgumentError(absl::StrCat(
                    "PackedDecompressSum: code must be [", rows, ", ", layouts_.total_bytes(),
                    "], got shape ", code.shape().DebugString())));
    OP_REQUIRES(ctx, TensorShapeUtils::IsScalar(scale_t.shape()),
                absl::InvalidArgumentError(absl::StrCat(
                    "PackedDecompressSum: scale must be a scalar, got shape ",
                    scale_t.shape().DebugString())));
    const T scale = scale_t.scalar<T>()();
    const bool scaled = !(scale == T(1));
    const T* v = values.flat<T>().data();
    const uint8_t* c = code.flat<uint8_t>().data();
    const int64_t k_total = layouts_.total_k();
    const int64_t bytes_total = layouts_.total_bytes();
    std::vector<int64_t> idx;
    int64_t v_at = 0, c_at = 0;
    for (size_t i = 0; i < layouts_.size(); ++i) {
      TensorShape shape;
      OP_REQUIRES(ctx, shapes_[i].AsTensorShape(&shape),
                  absl::InternalError("PackedDecompressSum: shape"));
      Tensor* dense = nullptr;
      OP_REQUIRES_OK(ctx, ctx->allocate_output(i, shape, &dense));
      T* out = dense->flat<T>().data();
      const int64_t n = layouts_.n(i);
      const int64_t k = layouts_.k(i);
      std::fill(out, out + n, T(0));
      idx.resize(k);
      for (int64_t r = 0; r < rows && k; ++r) {
        OP_REQUIRES_OK(ctx, DecodeRow(c + r * bytes_total + c_at, r, k, n, layouts_.layout(i),
                                      idx.data()));
        const T* row = v + r * k_total + v_at;
        for (int64_t j = 0; j < k; ++j) out[idx[j]] = out[idx[j]] + row[j];
      }
      if (scaled) {
        for (int64_t j = 0; j < n; ++j) out[j] = out[j] * scale;
      }
      v_at += k;
      c_at += layouts_.layout(i).bytes;
    }
  }

 private:
  std::vector<PartialTensorShape> shapes_;
  PackedLayouts layouts_;
};

REGISTER_KERNEL_BUILDER(
    Name("IndexCodeEncodePacked").Device(DEVICE_CPU).TypeConstraint<int32_t>("Tindex"),
    IndexCodeEncodePackedOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("IndexCodeEncodePacked").Device(DEVICE_CPU).TypeConstraint<int64_t>("Tindex"),
    IndexCodeEncodePackedOp<int64_t>);
REGISTER_KERNEL_BUILDER(
    Name("IndexCodeDecodePacked").Device(DEVICE_CPU).TypeConstraint<int32_t>("index_type"),
    IndexCodeDecodePackedOp<int32_t>);
REGISTER_KERNEL_BUILDER(
    Name("IndexCodeDecodePacked").Device(DEVICE_CPU).TypeConstraint<int64_t>("index_type"),
    IndexCodeDecodePackedOp<int64_t>);
#define TFS_REGISTER_PACKED_SUM(T)                                                            \
  REGISTER_KERNEL_BUILDER(Name("PackedDecompressSum").Device(DEVICE_CPU).TypeConstraint<T>("T"), \
                          PackedDecompressSumOp<T>);
TFS_REGISTER_PACKED_SUM(Eigen::half)
TFS_REGISTER_PACKED_SUM(Eigen::bfloat16)
TFS_REGISTER_PACKED_SUM(float)
TFS_REGISTER_PACKED_SUM(double)
#undef TFS_REGISTER_PACKED_SUM

#define TFS_REGISTER_INDEX_CODE(Index)                                                      \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("IndexCodeEncode").Device(DEVICE_CPU).TypeConstraint<Index>("Tindex"),           \
      IndexCodeEncodeOp<Index>);                                                            \
  REGISTER_KERNEL_BUILDER(                                                                  \
      Name("IndexCodeDecode").Device(DEVICE_CPU).TypeConstraint<Index>("index_type"),       \
      IndexCodeDecodeOp<Index>);

TFS_REGISTER_INDEX_CODE(int32_t)
TFS_REGISTER_INDEX_CODE(int64_t)

#undef TFS_REGISTER_INDEX_CODE

}  // namespace
}  // namespace tfs_ops
}  // namespace tensorflow
