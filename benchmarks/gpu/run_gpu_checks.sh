#!/usr/bin/env bash
# GPU checks of the TF-free CUDA core on a machine with nvcc, NumPy and PyTorch (no
# TensorFlow): builds custom_ops/cuda into libtfs_cuda.so for this GPU's architecture,
# runs the small cases under compute-sanitizer (memcheck, racecheck, synccheck, initcheck) when
# it is installed, then checks the core against the NumPy model (the CPU kernels' semantics) on
# adversarial cases, on a non-default stream, in a CUDA graph, with guard bytes and misaligned
# inputs, and times it at n = 100M (k = 1% and 0.1%, every dtype) against torch.topk plus
# residual ops and a device copy of the same bytes, and ScatterSum (float32, float16) against
# torch's index_add_ / scatter_add_, a zero-fill and a copy.
# Usage: bash benchmarks/gpu/run_gpu_checks.sh [gpu_check.py options]; builds and logs to
# $OUT/tfs_gpu (or /tmp/tfs_gpu); CUDA_ARCH=90 overrides the detected architecture;
# SANITIZE=0 skips compute-sanitizer, SANITIZER_TIMEOUT (seconds, default 300) bounds each tool.
# About 4 minutes on an H200 (15 s of it compiling).
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
FLAGS=(-std=c++17 -O3 --fmad=false -Xcompiler -fPIC -Icustom_ops/include
       -gencode "arch=compute_$CAP,code=sm_$CAP")
start=$(date +%s)
pids=()
objects=()
for source in topk qsgd scatter_sum; do
  "$NVCC" "${FLAGS[@]}" -c "custom_ops/cuda/$source.cu" -o "$BUILD/$source.o" &
  pids+=($!)
  objects+=("$BUILD/$source.o")
done
for pid in "${pids[@]}"; do
  wait "$pid"
done
"$NVCC" -shared -cudart static "${objects[@]}" -o "$BUILD/libtfs_cuda.so"
echo "built $BUILD/libtfs_cuda.so in $(( $(date +%s) - start )) s"
status=0
SAN=$(command -v compute-sanitizer || echo "$(dirname "$NVCC")/compute-sanitizer")
if [[ "${SANITIZE:-1}" != 0 && -x "$SAN" ]]; then
  # The four tools run side by side (separate processes on one GPU), before the timed part.
  # One cudaMalloc per tensor, so that memcheck sees every buffer's end. racecheck is slow
  # and checks shared memory, whose use does not depend on the dtype beyond its width: it
  # runs the 16- and 32-bit kinds.
  tools=(memcheck racecheck synccheck initcheck)
  san_pids=()
  for tool in "${tools[@]}"; do
    kinds=()
    [[ $tool == racecheck ]] && kinds=(--kinds float16,float32)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "${SANITIZER_TIMEOUT:-300}" "$SAN" --tool "$tool" \
      --error-exitcode 3 "$PY" benchmarks/gpu/gpu_check.py --lib "$BUILD/libtfs_cuda.so" \
      --small "${kinds[@]}" > "$BUILD/sanitizer_$tool.log" 2>&1 &
    san_pids+=($!)
  done
  for i in "${!tools[@]}"; do
    if wait "${san_pids[$i]}"; then
      echo "compute-sanitizer ${tools[$i]}: clean"
    else
      echo "compute-sanitizer ${tools[$i]}: FAILED (tail of $BUILD/sanitizer_${tools[$i]}.log below)"
      grep -v "Host Frame" "$BUILD/sanitizer_${tools[$i]}.log" | tail -n 30
      status=1
    fi
  done
  echo "sanitizers done at $(( $(date +%s) - start )) s"
else
  echo "compute-sanitizer: skipped (not found or SANITIZE=0)"
fi
"$PY" benchmarks/gpu/gpu_check.py --lib "$BUILD/libtfs_cuda.so" "$@" 2>&1 |
  tee "$BUILD/gpu_check.log"
check=${PIPESTATUS[0]}
exit $(( status || check ))
