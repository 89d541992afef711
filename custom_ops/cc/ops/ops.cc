// Op registrations and shape functions of tf_sparsify's custom ops.
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tfs_common.h"

namespace tensorflow {

using shape_inference::DimensionHandle;
using shape_inference::InferenceContext;
using shape_inference::ShapeHandle;

REGISTER_OP("TopKErrorFeedback")
    .Input("grad: T")
    .Input("residual: T")
    .Input("k: Tk")
    .Output("values: T")
    .Output("indices: index_type")
    .Output("new_residual: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tk: {int32, int64} = DT_INT32")
    .Attr("index_type: {int32, int64} = DT_INT32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle acc;
      TF_RETURN_IF_ERROR(c->Merge(c->input(0), c->input(1), &acc));
      ShapeHandle k_shape;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &k_shape));
      DimensionHandle k;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &k));
      c->set_output(0, c->Vector(k));
      c->set_output(1, c->Vector(k));
      c->set_output(2, acc);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Fused top-k selection with error feedback.

acc = grad + residual (in T); selects the k entries of acc of largest magnitude, ranked by
the IEEE bit pattern with the sign cleared (NaN ranks above +Inf, +0.0 equals -0.0), ties to
the lowest flat index. indices: ascending flat indices; values = acc[indices];
new_residual = acc with the selected entries set to +0.0 (it may reuse residual's buffer).
Denormals (TensorFlow's CPU policy): float32/float64/bfloat16 operands and sums below the
smallest normal are zeros of the same sign; float16 (added in float32) keeps them. The GPU
kernel takes n < 2^31; index_type int32 needs n < 2^31.
)doc");

REGISTER_OP("QSGDQuantize")
    .Input("tensor: T")
    .Input("seed: int64")
    .Output("signed_levels: out_type")
    .Output("norms: float")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("levels: int")
    .Attr("bucket_size: int")
    .Attr("out_type: {int8, int16}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle seed;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &seed));
      int64_t bucket_size;
      TF_RETURN_IF_ERROR(c->GetAttr("bucket_size", &bucket_size));
      DimensionHandle n = c->NumElements(c->input(0));
      c->set_output(0, c->Vector(n));
      if (c->ValueKnown(n) && bucket_size >= 0) {
        c->set_output(1, c->Vector(tfs::NumBuckets(c->Value(n), bucket_size)));
      } else {
        c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Bucketed QSGD quantization with counter-based stochastic rounding.

Per bucket of bucket_size flat entries (all of them when 0): norm = float32(sqrt(pairwise
float64 sum of squares)); r = |x| / norm * levels; level = floor(r) + (u < frac(r)) with
u = hash_uniform(seed, i), capped at levels; signed_levels (flat, [n]) = sign(x) * level,
0 where the level is NaN. bucket_size >= n means one bucket. Denormal inputs and quotients
are flushed to zero (TensorFlow's CPU policy); finite inputs beyond float32's range count as
+-FLT_MAX and finite norms above FLT_MAX are sent as FLT_MAX.
)doc");

REGISTER_OP("QSGDDequantize")
    .Input("signed_levels: Tq")
    .Input("norms: float")
    .Input("shape: Tshape")
    .Output("output: dtype")
    .Attr("Tq: {int8, int16}")
    .Attr("levels: int")
    .Attr("bucket_size: int")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("Tshape: {int32, int64} = DT_INT32")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle norms;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &norms));
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromShapeTensor(2, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
QSGD decoder: output = dtype(signed_level * (norm_of_bucket / levels)) reshaped to shape,
clamped to dtype's largest finite magnitude; denormal scales flush to zero.
)doc");

REGISTER_OP("ScatterSum")
    .Input("values: T")
    .Input("indices: Tindex")
    .Input("n: int64")
    .Output("dense: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tindex: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle values;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &values));
      ShapeHandle indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 1, &indices));
      TF_RETURN_IF_ERROR(c->Merge(values, indices, &values));
      ShapeHandle n_shape;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &n_shape));
      DimensionHandle n;
      TF_RETURN_IF_ERROR(c->MakeDimForScalarInput(2, &n));
      c->set_output(0, c->Vector(n));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Dense sum of sparse values: dense[j] = sum of values[i] with indices[i] == j, 0 elsewhere.

values and indices are vectors of one length, n >= 0. The CPU kernel adds duplicates in input
order with T's addition (float16 and bfloat16 through float32, denormals as in TensorFlow's
CPU policy), bit-identical to UnsortedSegmentSum, and fails on an index outside [0, n). The GPU
kernel adds with atomics and skips out-of-range indices; it matches the CPU bit for bit where an
index occurs at most twice, while sums of three or more duplicates depend on the order of the
atomic additions.
)doc");

REGISTER_OP("IndexCodeEncode")
    .Input("indices: Tindex")
    .Output("code: uint8")
    .Attr("Tindex: {int32, int64}")
    .Attr("num_elements: int >= 0")
    .Attr("low_bits: int >= 0")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &indices));
      int64_t n, low_bits;
      TF_RETURN_IF_ERROR(c->GetAttr("num_elements", &n));
      TF_RETURN_IF_ERROR(c->GetAttr("low_bits", &low_bits));
      DimensionHandle k = c->Dim(indices, 0);
      c->set_output(0, c->ValueKnown(k) ? c->Vector(tfs::IndexCodeBytes(n, c->Value(k), low_bits))
                                        : c->Vector(InferenceContext::kUnknownDim));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Elias-Fano code of k strictly ascending indices in [0, num_elements) (uint8, bits
little-endian). With L = low_bits and H = ((num_elements - 1) >> L) + k, index j (value x)
sets bit (x >> L) + j of the map (bits [0, H)) and puts x mod 2^L at bit H + j * L; the rest is
0. ceil((H + k * L) / 8) bytes, none when k = 0. Unsorted, repeated or out-of-range indices
fail with InvalidArgument.
)doc");

REGISTER_OP("IndexCodeDecode")
    .Input("code: uint8")
    .Output("indices: index_type")
    .Attr("num_elements: int >= 0")
    .Attr("k: int >= 0")
    .Attr("low_bits: int >= 0")
    .Attr("index_type: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle code;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &code));
      int64_t k;
      TF_RETURN_IF_ERROR(c->GetAttr("k", &k));
      ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(code, -1, c->MakeDim(k), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Inverse of IndexCodeEncode on the last axis: code [..., bytes] gives the [..., k] indices of
each row (rows decode in parallel). A row that is not the code of k strictly ascending indices
below num_elements (its map holds other than k ones, it decodes an index >= num_elements or
indices that do not ascend, or a padding bit is set) fails with InvalidArgument naming the row.
)doc");

REGISTER_OP("SparseSgdApply")
    .Input("var: resource")
    .Input("values: T")
    .Input("indices: Tindex")
    .Input("scale: T")
    .Input("learning_rate: T")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tindex: {int32, int64}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle values;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 2, &values));
      TF_RETURN_IF_ERROR(c->Merge(values, c->input(2), &values));
      ShapeHandle scalar;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(3), 0, &scalar));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(4), 0, &scalar));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Plain SGD steps with sparse, gathered updates, in place: row after row, for each entry
var[indices[r, j]] -= (values[r, j] * scale) * learning_rate in T's arithmetic; other entries
are untouched. values and indices are [rows, k]; each row of indices is strictly ascending, in
[0, size of var). With one row, or rows that share no index, the result is bit-identical to
subtracting (ScatterSum(values, indices) * scale) * learning_rate densely. Like
AssignSubVariableOp, the variable's buffer is copied first when a read still holds it. Bad
indices fail with InvalidArgument before var changes.
)doc");

REGISTER_OP("SparseSgdApplyPacked")
    .Input("vars: N * resource")
    .Input("values: T")
    .Input("indices: Tindex")
    .Input("scale: T")
    .Input("learning_rate: T")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("Tindex: {int32, int64}")
    .Attr("ks: list(int)")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      const int num = c->num_inputs() - 4;
      ShapeHandle values;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num), 2, &values));
      TF_RETURN_IF_ERROR(c->Merge(values, c->input(num + 1), &values));
      ShapeHandle scalar;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num + 2), 0, &scalar));
      TF_RETURN_IF_ERROR(c->WithRank(c->input(num + 3), 0, &scalar));
      return absl::OkStatus();
    })
    .Doc(R"doc(
SparseSgdApply of N variables in one op: vars[i]'s entries are the ks[i] columns of values and
indices ([rows, sum(ks)]) after those of vars[0..i), its indices flat within vars[i] and
strictly ascending in each row. The same bits as one SparseSgdApply per variable on its
columns; every variable is checked before any changes.
)doc");

REGISTER_OP("SaturatingCastFeedback")
    .Input("grad: float")
    .Input("residual: N * float")
    .Output("wire: wire_type")
    .Output("new_residual: N * float")
    .Attr("wire_type: {half, bfloat16}")
    .Attr("N: int >= 0")
    .Attr("portable: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      int64_t count;
      TF_RETURN_IF_ERROR(c->GetAttr("N", &count));
      if (count > 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("SaturatingCastFeedback: at most one residual, got N = ", count));
      }
      ShapeHandle shape = c->input(0);
      if (count == 1) {
        TF_RETURN_IF_ERROR(c->Merge(shape, c->input(1), &shape));
        c->set_output(1, shape);
      }
      c->set_output(0, shape);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Cast to a 16-bit wire type with error feedback, in one pass.

v = grad + residual (grad alone when N = 0); wire = v rounded to nearest even, finite values
beyond wire_type's range saturated to its largest finite value, Inf kept, NaN quieted as Cast
does (half: sign and top payload bits kept; bfloat16: 0x7FC0); with a residual (N = 1),
new_residual = v - float(wire) (it may reuse residual's buffer). Denormals (TensorFlow's CPU
policy): denormal inputs read as zero and a denormal new_residual entry is flushed, keeping
signs. portable: skip the F16C / AVX512-BF16 paths (for tests; the bits are the same).
)doc");

REGISTER_OP("TopKErrorFeedbackPacked")
    .Input("grads: N * T")
    .Input("residuals: N * T")
    .Output("values: T")
    .Output("indices: index_type")
    .Output("new_residuals: N * T")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("ks: list(int)")
    .Attr("index_type: {int32, int64} = DT_INT32")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> ks;
      TF_RETURN_IF_ERROR(c->GetAttr("ks", &ks));
      int64_t total = 0;
      for (int64_t k : ks) total += k;
      const int num = c->num_inputs() / 2;
      for (int i = 0; i < num; ++i) {
        ShapeHandle acc;
        TF_RETURN_IF_ERROR(c->Merge(c->input(i), c->input(num + i), &acc));
        c->set_output(2 + i, acc);
      }
      c->set_output(0, c->Vector(total));
      c->set_output(1, c->Vector(total));
      return absl::OkStatus();
    })
    .Doc(R"doc(
TopKErrorFeedback of N tensors in one op, tensor i with its own k = ks[i]: values and indices
are the N outputs concatenated in input order (indices flat within their own tensor),
new_residuals[i] is tensor i's new residual (the same bits as N TopKErrorFeedback ops).
)doc");

REGISTER_OP("IndexCodeEncodePacked")
    .Input("indices: Tindex")
    .Output("code: uint8")
    .Attr("Tindex: {int32, int64}")
    .Attr("num_elements: list(int)")
    .Attr("ks: list(int)")
    .Attr("low_bits: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> ns, ks, low;
      TF_RETURN_IF_ERROR(c->GetAttr("num_elements", &ns));
      TF_RETURN_IF_ERROR(c->GetAttr("ks", &ks));
      TF_RETURN_IF_ERROR(c->GetAttr("low_bits", &low));
      if (ks.size() != ns.size() || low.size() != ns.size()) {
        return absl::InvalidArgumentError(
            "IndexCodeEncodePacked: num_elements, ks and low_bits must have one entry per tensor");
      }
      int64_t bytes = 0;
      for (size_t i = 0; i < ns.size(); ++i) bytes += tfs::IndexCodeBytes(ns[i], ks[i], low[i]);
      ShapeHandle indices;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &indices));
      c->set_output(0, c->Vector(bytes));
      return absl::OkStatus();
    })
    .Doc(R"doc(
IndexCodeEncode of consecutive segments of indices (segment i: ks[i] indices below
num_elements[i], low_bits[i]), the codes concatenated.
)doc");

REGISTER_OP("IndexCodeDecodePacked")
    .Input("code: uint8")
    .Output("indices: index_type")
    .Attr("num_elements: list(int)")
    .Attr("ks: list(int)")
    .Attr("low_bits: list(int)")
    .Attr("index_type: {int32, int64}")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<int64_t> ks;
      TF_RETURN_IF_ERROR(c->GetAttr("ks", &ks));
      int64_t total = 0;
      for (int64_t k : ks) total += k;
      ShapeHandle code;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &code));
      c->set_output(0, c->Matrix(c->Dim(code, 0), total));
      return absl::OkStatus();
    })
    .Doc(R"doc(
Inverse of IndexCodeEncodePacked, row by row: code [replicas, bytes] gives the
[replicas, sum(ks)] indices, each segment's flat within its own tensor; an invalid segment
fails as IndexCodeDecode does.
)doc");

REGISTER_OP("PackedDecompressSum")
    .Input("values: T")
    .Input("code: uint8")
    .Input("scale: T")
    .Output("dense: N * T")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double}")
    .Attr("shapes: list(shape)")
    .Attr("ks: list(int)")
    .Attr("low_bits: list(int)")
    .SetShapeFn([](InferenceContext* c) {
      std::vector<PartialTensorShape> shapes;
      TF_RETURN_IF_ERROR(c->GetAttr("shapes", &shapes));
      for (size_t i = 0; i < shapes.size(); ++i) {
        ShapeHandle out;
        TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shapes[i], &out));
        c->set_output(i, out);
      }
      return absl::OkStatus();
    })
    .Doc(R"doc(
Decompressed sum of gathered packed TopK payloads: values [replicas, sum(ks)] and code
[replicas, sum of the segments' code bytes] (IndexCodeEncodePacked's layout); dense[i] (of
shapes[i]) is the sum over the rows of segment i's values at its decoded indices (rows add in
order onto zeros, as ScatterSum), times scale. A row whose segment is not a valid code fails
as IndexCodeDecode does.
)doc");

REGISTER_OP("WireToFloat")
    .Input("wire: wire_type")
    .Input("scale: float")
    .Output("output: float")
    .Output("finite: bool")
    .Attr("wire_type: {half, bfloat16}")
    .Attr("portable: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle scale;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &scale));
      c->set_output(0, c->input(0));
      c->set_output(1, c->Scalar());
      return absl::OkStatus();
    })
    .Doc(R"doc(
Decoder of SaturatingCastFeedback's wire: output = float(wire) * scale (float32 arithmetic;
denormal inputs and products are zeros of their sign, TensorFlow's CPU policy); finite: whether
every entry of wire is finite, found in the same pass. portable: as SaturatingCastFeedback's.
)doc");

REGISTER_OP("WireSum")
    .Input("gathered: wire_type")
    .Output("sum: wire_type")
    .Attr("wire_type: {half, bfloat16}")
    .Attr("portable: bool = false")
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle gathered;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &gathered));
      ShapeHandle sum;
      TF_RETURN_IF_ERROR(c->Subshape(gathered, 1, &sum));
      c->set_output(0, sum);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Sum of gathered 16-bit payloads over their first axis (the ranks), as
Cast(ReduceSum(Cast(gathered, float), 0), wire_type) gives it, in one pass: each entry added in
float32 from +0.0 in rank order (denormals: TensorFlow's CPU policy), rounded once to nearest
even, to Inf beyond wire_type's range; NaN sums are 0x7E00 (half) or 0x7FC0 (bfloat16). With
one rank the row itself (NaNs as above). portable: as SaturatingCastFeedback's.
)doc");

}  // namespace tensorflow
