/* C API of the TensorFlow-free CUDA core of tf_sparsify's ops.
 *
 * Every pointer is a device pointer; work is queued on `stream` and nothing synchronizes with
 * the host. Functions return TFS_OK, TFS_ERR_ARG for invalid arguments, or a cudaError_t
 * (positive). The semantics are those of tf_sparsify/ops/reference.py.
 */
#ifndef TFS_CUDA_H_
#define TFS_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#else
typedef struct CUstream_st* cudaStream_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of grad/residual/values (TopK), of the QSGD input/output and of ScatterSum. */
enum { TFS_F16 = 0, TFS_BF16 = 1, TFS_F32 = 2, TFS_F64 = 3 };
enum { TFS_OK = 0, TFS_ERR_ARG = -1 };

/* Device workspace that tfs_topk_error_feedback needs for n elements and k selections. */
int tfs_topk_workspace_bytes(int dtype, int64_t n, int64_t k, size_t* bytes);

/* acc = grad + residual -> new_residual (may equal residual); selects the k largest keys
 * (sign-masked bit patterns, ties to the lowest index) into values[k] and ascending
 * indices[k] (int32 when index_bytes is 4, int64 when 8) and zeroes them in new_residual.
 * Denormal operands and sums of float32/float64/bfloat16 are flushed to signed zeros (the
 * ops' policy, that of TensorFlow's CPU). Requires 0 <= k <= n < 2^31 (TFS_ERR_ARG beyond:
 * the TF op runs larger tensors on its CPU kernel). Inputs need no alignment. */
int tfs_topk_error_feedback(int dtype, const void* grad, const void* residual,
                            void* new_residual, int64_t n, int64_t k, void* values,
                            void* indices, int index_bytes, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

/* Device workspace that tfs_qsgd_quantize needs (bucket_size is clamped to n, so any
 * bucket_size >= 0 gives a workspace of O(n / min(bucket_size, n)) bytes). */
int tfs_qsgd_workspace_bytes(int64_t n, int64_t bucket_size, size_t* bytes);

/* signed_levels[n] is int8 when levels <= 127, else int16; norms has one float per bucket.
 * Buckets of min(bucket_size, n) entries (bucket_size 0: one bucket); denormals flushed and
 * values beyond float32's range saturated as in tfs_common.h. */
int tfs_qsgd_quantize(int dtype, const void* input, int64_t n, int levels, int64_t bucket_size,
                      int64_t seed, void* signed_levels, float* norms, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

int tfs_qsgd_dequantize(int dtype, const void* signed_levels, const float* norms, int64_t n,
                        int levels, int64_t bucket_size, void* output, cudaStream_t stream);

/* dense[n] = sum of values[i] over indices[i] == j (int32 when index_bytes is 4, int64 when 8),
 * zero elsewhere: dense is zeroed, then the m values are added with atomics. Indices outside
 * [0, n) are skipped. Denormal values and sums are flushed as in tfs_common.h (not float16's).
 * An index that occurs at most twice gets the CPU kernel's bits; three or more values at one
 * index sum in an unspecified order, and NaN results carry the GPU's NaN bits. */
int tfs_scatter_sum(int dtype, const void* values, const void* indices, int index_bytes,
                    int64_t m, int64_t n, void* dense, cudaStream_t stream);

/* The CUDA runtime version this library was built with and the driver's (e.g. 12050 for 12.5;
 * driver 0 when there is none). */
int tfs_cuda_versions(int* runtime, int* driver);

/* Human-readable message of a return code. */
const char* tfs_error_string(int code);

#ifdef __cplusplus
}
#endif

#endif /* TFS_CUDA_H_ */
