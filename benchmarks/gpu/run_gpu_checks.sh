#!/usr/bin/env bash
# GPU checks of the TF-free CUDA core on a machine with nvcc, NumPy and PyTorch (no
# TensorFlow): builds tf_sparsify/ops/src/cuda into libtfs_cuda.so for this GPU's architecture, checks it
# against the NumPy model on adversarial cases, then times it at n = 100M (k = 1% and 0.1%)
# against torch.topk plus residual ops and against copies of the same bytes.
# Usage: bash benchmarks/gpu/run_gpu_checks.sh [gpu_check.py options]; builds and logs to
# $OUT/tfs_gpu (or /tmp/tfs_gpu); CUDA_ARCH=90 overrides the detected architecture. About 2
# minutes on an H200 (30 s of it compiling).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")}
PY=${PYTHON:-python3}
BUILD=${OUT:-/tmp}/tfs_gpu
mkdir -p "$BUILD"
CAP=${CUDA_ARCH:-}
if [[ -z "$CAP" ]]; then
  CAP=$( (nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null || true) |
        head -n1 | tr -d '. ')
fi
if [[ -z "$CAP" ]]; then
  CAP=$("$PY" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
fi
echo "nvcc: $("$NVCC" --version | tail -n1); building for sm_$CAP"
FLAGS=(-std=c++17 -O3 --fmad=false -Xcompiler -fPIC -Itf_sparsify/ops/src/include
       -gencode "arch=compute_$CAP,code=sm_$CAP")
start=$(date +%s)
"$NVCC" "${FLAGS[@]}" -c tf_sparsify/ops/src/cuda/topk.cu -o "$BUILD/topk.o" &
topk=$!
"$NVCC" "${FLAGS[@]}" -c tf_sparsify/ops/src/cuda/qsgd.cu -o "$BUILD/qsgd.o" &
qsgd=$!
wait "$topk"
wait "$qsgd"
"$NVCC" -shared -cudart static "$BUILD/topk.o" "$BUILD/qsgd.o" -o "$BUILD/libtfs_cuda.so"
echo "built $BUILD/libtfs_cuda.so in $(( $(date +%s) - start )) s"
"$PY" benchmarks/gpu/gpu_check.py --lib "$BUILD/libtfs_cuda.so" "$@" 2>&1 |
  tee "$BUILD/gpu_check.log"
exit "${PIPESTATUS[0]}"
