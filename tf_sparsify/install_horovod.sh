#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (TensorFlow + Gloo, no MPI/PyTorch/MXNet) into a virtualenv
# that already has TensorFlow 2.21 installed.
#
# Usage: install_horovod.sh [VENV | PYTHON] [--dry-run]
#   VENV     a virtualenv's folder (default .venv); its bin/python is the interpreter
#   PYTHON   an interpreter; Horovod goes into its environment (sys.prefix)
#   --dry-run  check what is installed and what the build needs, say what would be done, and
#              stop before installing or downloading anything
#
# The package ships this file: `python -m tf_sparsify install-horovod [--dry-run]` runs it with
# the running interpreter, and so do `make horovod` and scripts/install_horovod.sh (a link to it)
# in a checkout.
#
# Horovod 0.28.1 does not build from PyPI as-is against TF 2.21: its optional XLA ops source
# (horovod/tensorflow/xla_mpi_ops.cc) includes XLA headers that have moved. We download the
# sdist, drop that one source from the TensorFlow CMake target and build with the system cmake.
# Only what TensorFlow loads is built (the one Gloo library it links, not the C++11 one),
# without debug info (the library is 2 MB, not 50), without looking for a CUDA compiler, and
# linked with gold where it is installed: about 1.3 minutes on 2 cores instead of 2.
#
# Gloo, as Horovod bundles it, sums float16 one element at a time in software unless it is
# configured with USE_AVX (nothing sets it), which makes a float16 all-reduce about twice as
# slow as a float32 one of twice the bytes. On CPUs with AVX and F16C (Horovod compiles
# everything with -mavx -mf16c anyway) we turn it on, so float16 sums use F16C.
#
# The script is idempotent: if `import horovod.tensorflow` works in VENV, Horovod was built with
# Gloo and `horovodrun` runs, it exits at once.
#
# Environment knobs:
#   HOROVOD_REINSTALL=1   rebuild even when a working Horovod is already installed
#   HOROVOD_BUILD_JOBS=N  parallel compile jobs (default: number of CPUs, at most 8)
#   HOROVOD_CMAKE=PATH    cmake binary to use (default: /usr/bin/cmake, else cmake on PATH,
#                         else `apt-get install cmake`)
#   KEEP_BUILD_DIR=1      keep the temporary build directory
set -euo pipefail

HOROVOD_VERSION=0.28.1
START_SECONDS=$SECONDS

log() { printf '[install_horovod] %s\n' "$*" >&2; }
die() {
    printf '\n[install_horovod] ERROR: %s\n' "$*" >&2
    exit 1
}

TARGET=.venv
DRY_RUN=0
for arg in "$@"; do
    case $arg in
        --dry-run) DRY_RUN=1 ;;
        -*) die "unknown option '$arg' (usage: install_horovod.sh [VENV | PYTHON] [--dry-run])" ;;
        *) TARGET=$arg ;;
    esac
done
if [[ -f "$TARGET" && -x "$TARGET" ]]; then
    PY=$TARGET
    VENV=$("$PY" -c 'import sys; print(sys.prefix)') || die "'$PY' does not run"
else
    [[ -d "$TARGET" ]] || die "virtualenv '$TARGET' does not exist (pass the venv path as first argument)"
    VENV=$(cd "$TARGET" && pwd)
    PY="$VENV/bin/python"
    [[ -x "$PY" ]] || die "'$PY' is not an executable python; is '$VENV' a virtualenv?"
fi

# Keep TensorFlow's start-up chatter out of our checks.
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

# ---------------------------------------------------------------------------------------------
# 0. Already installed?
# ---------------------------------------------------------------------------------------------
# Not `horovodrun --check-build`: it tells no more (it tests that `import horovod.<framework>`
# succeeds, and reads gloo_built()), and imports every framework again in subprocesses, ~20 s on
# 2 cores. The import below loads the TensorFlow op library for real.
IMPORT_CHECK="import horovod, horovod.tensorflow as hvd
assert hvd.gloo_built(), 'not built with Gloo'
print(f'Horovod {horovod.__version__} with TensorFlow and Gloo')"
horovod_works() {
    # Prints "Horovod VERSION with TensorFlow and Gloo"; non-zero if anything is missing.
    local out
    out=$("$PY" -c "$IMPORT_CHECK") || return 1
    [[ -x "$VENV/bin/horovodrun" ]] && "$VENV/bin/horovodrun" --version >/dev/null || return 1
    tail -n 1 <<<"$out"
}

# What this script builds; a Horovod built with other options is rebuilt.
if grep -qw avx /proc/cpuinfo 2>/dev/null && grep -qw f16c /proc/cpuinfo 2>/dev/null; then
    GLOO_AVX=ON
else
    GLOO_AVX=OFF
fi
BUILD_ID="horovod $HOROVOD_VERSION, TensorFlow + Gloo, gloo F16C float16 sums: $GLOO_AVX"
BUILD_ID_FILE="$VENV/.horovod_build"
same_build() { [[ -f "$BUILD_ID_FILE" && "$(cat "$BUILD_ID_FILE")" == "$BUILD_ID" ]]; }

if [[ "${HOROVOD_REINSTALL:-0}" != 1 ]] && same_build && report=$(horovod_works 2>/dev/null); then
    log "$report is already installed in $VENV; nothing to do ($((SECONDS - START_SECONDS))s)." \
        "Set HOROVOD_REINSTALL=1 to rebuild."
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# 1. Preconditions: TensorFlow in the venv, compilers and cmake on the machine.
# ---------------------------------------------------------------------------------------------
# From the installed distributions' metadata, not an import (~5 s on 2 cores): the build's
# configure step imports TensorFlow anyway, and the verification at the end loads Horovod's
# library into it.
VERSIONS="import platform; from importlib.metadata import packages_distributions as found, version
print(f'python {platform.python_version()}, TensorFlow {version(found()[\"tensorflow\"][0])}')"
VERSIONS=$("$PY" -c "$VERSIONS" 2>/dev/null) ||
    die "TensorFlow is not installed for $PY; install tensorflow-cpu into the venv first"
log "venv: $VENV ($VERSIONS)"

APT_UPDATED=0
apt_install() {
    # apt_install PACKAGE...: install Debian packages (only called for missing tools).
    command -v apt-get >/dev/null 2>&1 ||
        die "missing build tools ($*) and apt-get is not available; install them by hand"
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 || die "need root (or sudo) to apt-get install $*"
        sudo=(sudo)
    fi
    log "installing Debian packages: $*"
    if [[ $APT_UPDATED -eq 0 ]]; then
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -qq ||
            die "apt-get update failed"
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$@" ||
        die "apt-get install $* failed"
}

missing_pkgs=()
command -v gcc >/dev/null 2>&1 || missing_pkgs+=(gcc)
command -v g++ >/dev/null 2>&1 || missing_pkgs+=(g++)
command -v make >/dev/null 2>&1 || missing_pkgs+=(make)
command -v tar >/dev/null 2>&1 || missing_pkgs+=(tar)
if [[ -z "${HOROVOD_CMAKE:-}" && ! -x /usr/bin/cmake ]] && ! command -v cmake >/dev/null 2>&1; then
    missing_pkgs+=(cmake)
fi
if [[ ${#missing_pkgs[@]} -gt 0 && $DRY_RUN == 1 ]]; then
    log "dry run ($0): would apt-get install ${missing_pkgs[*]}, then build Horovod" \
        "$HOROVOD_VERSION (about 1.3 minutes on 2 cores) and install it with $PY into $VENV"
    exit 0
elif [[ ${#missing_pkgs[@]} -gt 0 ]]; then
    apt_install "${missing_pkgs[@]}"
fi

# Prefer the system cmake (Debian 12: 3.25) over e.g. a pip-installed cmake 4 earlier on PATH.
if [[ -n "${HOROVOD_CMAKE:-}" ]]; then
    CMAKE_BIN=$HOROVOD_CMAKE
elif [[ -x /usr/bin/cmake ]]; then
    CMAKE_BIN=/usr/bin/cmake
else
    CMAKE_BIN=$(command -v cmake) || die "no cmake found"
fi
CMAKE_VERSION=$("$CMAKE_BIN" --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p') ||
    true
[[ -n "$CMAKE_VERSION" ]] || die "cannot determine the version of cmake '$CMAKE_BIN'"
CMAKE_MAJOR=${CMAKE_VERSION%%.*}
CMAKE_MINOR=${CMAKE_VERSION#*.}
CMAKE_MINOR=${CMAKE_MINOR%%.*}
if ((CMAKE_MAJOR < 3 || (CMAKE_MAJOR == 3 && CMAKE_MINOR < 13))); then
    die "cmake $CMAKE_VERSION at $CMAKE_BIN is too old; Horovod needs cmake >= 3.13"
fi
if ((CMAKE_MAJOR >= 4)); then
    # gloo's bundled CMakeLists declares cmake_minimum_required < 3.5, which cmake 4 rejects.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    log "cmake $CMAKE_VERSION ($CMAKE_BIN): setting CMAKE_POLICY_VERSION_MINIMUM=3.5"
else
    log "cmake $CMAKE_VERSION ($CMAKE_BIN)"
fi
export HOROVOD_CMAKE=$CMAKE_BIN

if [[ -n "${HOROVOD_BUILD_JOBS:-}" ]]; then
    JOBS=$HOROVOD_BUILD_JOBS
else
    JOBS=$(nproc 2>/dev/null || echo 2)
    if ((JOBS > 8)); then JOBS=8; fi
fi
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "HOROVOD_BUILD_JOBS must be a positive integer, got '$JOBS'"

if [[ $DRY_RUN == 1 ]]; then
    log "dry run ($0): would download the horovod==$HOROVOD_VERSION sdist, leave out" \
        "xla_mpi_ops.cc, gloo F16C float16 sums: $GLOO_AVX, build the TensorFlow library alone," \
        "without debug info, with make -j$JOBS (about 1.3 minutes on 2 cores) and install it with" \
        "$PY into $VENV"
    exit 0
fi

# ---------------------------------------------------------------------------------------------
# 2. Work in a temporary directory; all tool output goes to a log shown on failure.
# ---------------------------------------------------------------------------------------------
WORKDIR=$(mktemp -d "${TMPDIR:-/tmp}/install_horovod.XXXXXX")
LOG="$WORKDIR/build.log"
cleanup() {
    local rc=$?
    if [[ $rc -ne 0 ]]; then
        local saved="${TMPDIR:-/tmp}/install_horovod-$(date +%Y%m%d-%H%M%S).log"
        cp "$LOG" "$saved" 2>/dev/null || true
        printf '[install_horovod] FAILED after %ss; full log: %s\n' "$((SECONDS - START_SECONDS))" \
            "$saved" >&2
    fi
    if [[ "${KEEP_BUILD_DIR:-0}" == 1 ]]; then
        log "build directory kept: $WORKDIR"
    else
        rm -rf "$WORKDIR"
    fi
}
trap cleanup EXIT

step() {
    # step "DESCRIPTION" CMD...: run CMD with output appended to $LOG; on failure show the
    # end of the log and stop.
    local desc=$1 t0=$SECONDS
    shift
    log "$desc ..."
    printf '\n===== %s\n$ %s\n' "$desc" "$*" >>"$LOG"
    if ! "$@" >>"$LOG" 2>&1; then
        printf '\n----- last lines of the log -----\n' >&2
        tail -n 60 "$LOG" >&2
        die "step failed: $desc"
    fi
    log "  done in $((SECONDS - t0))s"
}

step "installing build helpers into the venv (cloudpickle psutil pyyaml packaging cffi setuptools wheel)" \
    "$PY" -m pip install --disable-pip-version-check cloudpickle psutil pyyaml packaging cffi setuptools wheel

step "downloading the horovod==$HOROVOD_VERSION sdist" \
    "$PY" -m pip download --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation \
    "horovod==$HOROVOD_VERSION" -d "$WORKDIR/dl"

SDIST=$(ls "$WORKDIR"/dl/horovod-"$HOROVOD_VERSION".tar.gz 2>/dev/null) ||
    die "pip download did not produce horovod-$HOROVOD_VERSION.tar.gz in $WORKDIR/dl"
step "unpacking $(basename "$SDIST")" tar -xzf "$SDIST" -C "$WORKDIR"
SRC="$WORKDIR/horovod-$HOROVOD_VERSION"
TF_CMAKELISTS="$SRC/horovod/tensorflow/CMakeLists.txt"
[[ -f "$TF_CMAKELISTS" ]] || die "unexpected sdist layout: $TF_CMAKELISTS is missing"

log "removing xla_mpi_ops.cc from horovod/tensorflow/CMakeLists.txt"
grep -q 'xla_mpi_ops\.cc' "$TF_CMAKELISTS" ||
    die "no line naming xla_mpi_ops.cc in $TF_CMAKELISTS; the sdist is not the expected one"
sed -i '/xla_mpi_ops\.cc/d' "$TF_CMAKELISTS"
! grep -q 'xla_mpi_ops\.cc' "$TF_CMAKELISTS" || die "could not remove xla_mpi_ops.cc from $TF_CMAKELISTS"

# setup.py builds RelWithDebInfo (-O3 -g): the debug info of sources that include TensorFlow's
# headers makes the compile slower and the library several times larger, for nobody to read.
TOP_CMAKELISTS="$SRC/CMakeLists.txt"
O3_LINE='string(REPLACE "-O2" "-O3" CMAKE_CXX_FLAGS_RELWITHDEBINFO "${CMAKE_CXX_FLAGS_RELWITHDEBINFO}")'
grep -qxF "$O3_LINE" "$TOP_CMAKELISTS" ||
    die "no RelWithDebInfo -O3 line in $TOP_CMAKELISTS; not the expected sdist"
log "building without debug info (-O3, no -g)"
sed -i "/^string(REPLACE \"-O2\" \"-O3\" CMAKE_CXX_FLAGS_RELWITHDEBINFO/a\\
foreach(lang C CXX)\\
    string(REPLACE \"-g\" \"\" CMAKE_\${lang}_FLAGS_RELWITHDEBINFO \"\${CMAKE_\${lang}_FLAGS_RELWITHDEBINFO}\")\\
endforeach()" "$TOP_CMAKELISTS"
grep -q 'string(REPLACE "-g" ""' "$TOP_CMAKELISTS" || die "could not drop -g in $TOP_CMAKELISTS"

# Gloo is built twice: as `gloo` (for frameworks built with the C++11 ABI at C++11) and as
# `compatible17_gloo`, the one TensorFlow's library links (TensorFlow is C++17). Only the
# library TensorFlow links gets built (another target needing `gloo` would still build it).
GLOO_ABI_LINE='    target_compile_definitions(gloo PRIVATE _GLIBCXX_USE_CXX11_ABI=1)'
grep -qxF "$GLOO_ABI_LINE" "$TOP_CMAKELISTS" ||
    die "no gloo target definitions in $TOP_CMAKELISTS; not the expected sdist"
sed -i 's|^    target_compile_definitions(gloo PRIVATE _GLIBCXX_USE_CXX11_ABI=1)$|&\n    set_target_properties(gloo PROPERTIES EXCLUDE_FROM_ALL TRUE)|' "$TOP_CMAKELISTS"
grep -q 'set_target_properties(gloo PROPERTIES EXCLUDE_FROM_ALL TRUE)' "$TOP_CMAKELISTS" ||
    die "could not leave the unused gloo library out of $TOP_CMAKELISTS"

if [[ "$GLOO_AVX" == ON ]]; then
    # gloo's own sources see GLOO_USE_AVX through its generated config.h; Horovod's include
    # gloo/math.h, which does not include config.h, so they need the definition too (else
    # they instantiate the software float16 sum themselves).
    log "gloo with USE_AVX (float16 sums with F16C)"
    grep -q '^    add_subdirectory(third_party/gloo)$' "$TOP_CMAKELISTS" ||
        die "no 'add_subdirectory(third_party/gloo)' in $TOP_CMAKELISTS; not the expected sdist"
    sed -i 's|^    add_subdirectory(third_party/gloo)$|    set(USE_AVX ON CACHE BOOL "gloo: AVX/F16C reductions" FORCE)\n    add_definitions(-DGLOO_USE_AVX=1)\n&|' \
        "$TOP_CMAKELISTS"
    grep -q 'add_definitions(-DGLOO_USE_AVX=1)' "$TOP_CMAKELISTS" ||
        die "could not enable USE_AVX in $TOP_CMAKELISTS"
    # ... and the bundled gloo does not compile math.cc, where the F16C sums are defined.
    GLOO_CMAKELISTS="$SRC/third_party/gloo/gloo/CMakeLists.txt"
    grep -q '^  "${CMAKE_CURRENT_SOURCE_DIR}/types.cc"$' "$GLOO_CMAKELISTS" ||
        die "no types.cc source in $GLOO_CMAKELISTS; not the expected sdist"
    sed -i 's|^  "${CMAKE_CURRENT_SOURCE_DIR}/types.cc"$|&\n  "${CMAKE_CURRENT_SOURCE_DIR}/math.cc"|' \
        "$GLOO_CMAKELISTS"
    grep -q '/math.cc"' "$GLOO_CMAKELISTS" || die "could not add math.cc to $GLOO_CMAKELISTS"
fi

# Horovod looks for a CUDA compiler in every build (CMake's check_language, then
# find_package(CUDAToolkit)) and identifies it where nvcc is installed: about 4 s of configure,
# for nothing here (CUDA sources are built only with HOROVOD_GPU_* operations, never set above).
CUDA_CHECK_LINE='check_language(CUDA)'
grep -qxF "$CUDA_CHECK_LINE" "$TOP_CMAKELISTS" ||
    die "no top-level '$CUDA_CHECK_LINE' in $TOP_CMAKELISTS; not the expected sdist"
log "no GPU operations: no CUDA compiler looked for"
sed -i "s|^$CUDA_CHECK_LINE\$|set(CMAKE_CUDA_COMPILER \"\")\nset(CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit TRUE)|" \
    "$TOP_CMAKELISTS"
grep -q 'set(CMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit TRUE)' "$TOP_CMAKELISTS" ||
    die "could not leave the CUDA check out of $TOP_CMAKELISTS"

# The library links against TensorFlow's libtensorflow_cc (hundreds of MB): GNU ld reads its
# symbols in about 7 s, gold in about 1 s (CMake takes LDFLAGS as its initial linker flags).
BUILD_LDFLAGS=${LDFLAGS:-}
if command -v ld.gold >/dev/null 2>&1 && printf 'int main(){}\n' |
    "${CXX:-c++}" -x c++ -fuse-ld=gold -o /dev/null - >/dev/null 2>&1; then
    log "linking with gold"
    BUILD_LDFLAGS="${BUILD_LDFLAGS:+$BUILD_LDFLAGS }-fuse-ld=gold"
fi

# Horovod's own sources (26 for the TensorFlow library) share most of their headers, and
# Gloo's 38 share theirs: CMake's unity build compiles Horovod's 7 to a unit (4 units, 2 cores
# stay busy) and Gloo's in one (its allreduce.cc apart: an alias of that file clashes with a
# class of another): 111 core-seconds for the install instead of 157 with a unit per file. Two
# units of Horovod's would cost less, but the one with TensorFlow's headers would take as long
# as the rest together and leave a core idle. CMake older than 3.16 (Gloo's: 3.18) ignores it.
log "compiling Horovod's sources 7 to a unit and Gloo's in one (CMake UNITY_BUILD)"
grep -q 'OUTPUT_NAME "mpi_lib"' "$TF_CMAKELISTS" ||
    die "no mpi_lib target in $TF_CMAKELISTS; not the expected sdist"
printf '%s\n' 'set_target_properties(${TF_TARGET_LIB} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 7)' \
    >>"$TF_CMAKELISTS"
GLOO17_LINE='    add_subdirectory(third_party/compatible17_gloo)'
grep -qxF "$GLOO17_LINE" "$TOP_CMAKELISTS" ||
    die "no '$GLOO17_LINE' in $TOP_CMAKELISTS; not the expected sdist"
GLOO17_UNITY='    if(NOT CMAKE_VERSION VERSION_LESS 3.18)\
        set_target_properties(compatible17_gloo PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 0)\
        set_source_files_properties(third_party/compatible17_gloo/gloo/allreduce.cc\
            DIRECTORY third_party/compatible17_gloo/gloo PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)\
    endif()'
sed -i "s|^    add_subdirectory(third_party/compatible17_gloo)\$|&\\n$GLOO17_UNITY|" "$TOP_CMAKELISTS"
grep -q 'compatible17_gloo PROPERTIES UNITY_BUILD ON' "$TOP_CMAKELISTS" ||
    die "could not compile Gloo's sources in one unit in $TOP_CMAKELISTS"

log "building (make -j$JOBS; about 1.3 minutes on 2 cores); log: $LOG"
step "building and installing horovod $HOROVOD_VERSION" \
    env HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 MAKEFLAGS="-j$JOBS" LDFLAGS="$BUILD_LDFLAGS" \
    "$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps --no-cache-dir \
    "$SRC"

# ---------------------------------------------------------------------------------------------
# 3. Verify.
# ---------------------------------------------------------------------------------------------
log "verifying: import horovod.tensorflow, built with Gloo, horovodrun runs"
report=$(horovod_works 2>>"$LOG") || {
    tail -n 30 "$LOG" >&2
    die "horovod was installed but 'import horovod.tensorflow' fails or lacks Gloo, or" \
        "$VENV/bin/horovodrun does not run"
}
log "$report"

printf '%s\n' "$BUILD_ID" >"$BUILD_ID_FILE"
log "Horovod $HOROVOD_VERSION installed into $VENV in $((SECONDS - START_SECONDS))s"
