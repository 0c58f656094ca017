#!/usr/bin/env bash
# Compile-only check of our CUDA code: the CUDA objects that blockspec's patches add or change,
# built from the same pinned sdist + ggml_patches/NNNN-*.patch as the wheel, with nvcc and no GPU.
#
#   bash ggml_patches/cuda_check.sh            (make cuda-check)
#
# Env: CUDA_ARCH (default 89: one architecture keeps it short), NVCC (default: nvcc on PATH),
#      BLOCKSPEC_CACHE (default ~/.cache/blockspec), JOBS (default 2),
#      CUDA_CHECK_SRC (an already patched vendor/llama.cpp to check instead of a fresh one).
#
# Only the objects below are compiled, never the whole ggml-cuda library: its ~140 .cu files
# (flash attention and mmq template instances) take hours on a 2-core machine, and none of them
# changes with our patches. Nothing is linked, so no GPU or driver is needed.
#   ggml-cuda/block-shift.cu  - patch 0005: the GGML_OP_BLOCK_SHIFT kernel
#   ggml-cuda/ggml-cuda.cu    - patch 0005: dispatch + supports_op (and every ggml.h change)
# A toolkit without cuBLAS headers (nvcc-only installs) gets them from the PyPI package
# nvidia-cublas of the toolkit's major.minor version, unpacked under $BLOCKSPEC_CACHE (headers only).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${BLOCKSPEC_CACHE:-$HOME/.cache/blockspec}"
arch="${CUDA_ARCH:-89}"
jobs="${JOBS:-2}"
nvcc="${NVCC:-$(command -v nvcc || true)}"
OBJECTS=(block-shift.cu.o ggml-cuda.cu.o)

die() { echo "cuda-check: $*" >&2; exit 1; }
[ -n "$nvcc" ] && [ -x "$nvcc" ] || die "nvcc not found (set NVCC=/path/to/nvcc)"
command -v cmake >/dev/null || die "cmake not found"
command -v python3 >/dev/null || die "python3 not found"

cuda_ver="$("$nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')"
[ -n "$cuda_ver" ] || die "cannot read the CUDA version from '$nvcc --version'"
echo "cuda-check: nvcc $cuda_ver ($nvcc), arch sm_$arch"

# 1. the patched source, exactly as build.py makes it for the wheel (or CUDA_CHECK_SRC: an
#    already patched vendor/llama.cpp, e.g. the tree a new patch is being written in)
if [ -n "${CUDA_CHECK_SRC:-}" ]; then
    llama="$(cd "$CUDA_CHECK_SRC" && pwd)"
else
    src="$(cd "$here" && python3 -c '
import sys
from pathlib import Path
import build
try:
    print(build.unpack_and_patch(build.fetch_sdist(), Path(sys.argv[1])))
except build.BuildError as e:
    sys.exit(f"cuda-check: {e}")
' "$cache/cuda-check/src")"
    llama="$src/vendor/llama.cpp"
fi
[ -f "$llama/ggml/src/ggml-cuda/ggml-cuda.cu" ] || die "no llama.cpp source tree at $llama"
[ -f "$llama/ggml/src/ggml-cuda/block-shift.cu" ] || die "$llama lacks patch 0005 (ggml-cuda/block-shift.cu)"

# 2. cuBLAS headers (ggml-cuda includes cublas_v2.h everywhere)
extra=()
if ! echo "#include <cublas_v2.h>" | "$nvcc" -x cu -E - -o /dev/null >/dev/null 2>&1; then
    cub="$cache/cuda-check/cublas-$cuda_ver"
    if [ ! -f "$cub/include/cublas_v2.h" ]; then
        echo "cuda-check: $nvcc finds no cublas_v2.h; fetching headers of nvidia-cublas==$cuda_ver.* with pip"
        rm -rf "$cub.tmp" && mkdir -p "$cub.tmp"
        python3 -m pip download -q --no-deps -d "$cub.tmp" "nvidia-cublas==$cuda_ver.*" \
            || die "pip could not fetch nvidia-cublas==$cuda_ver.*"
        whl="$(ls "$cub.tmp"/nvidia_cublas-*.whl | head -n1)"
        python3 - "$whl" "$cub.tmp/include" <<'EOF'
import sys, zipfile, pathlib
whl, out = sys.argv[1], pathlib.Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if "/include/" in n and n.endswith(".h")]
    if not any(n.endswith("/cublas_v2.h") for n in names):
        sys.exit(f"cuda-check: {whl} has no cublas_v2.h")
    for n in names:
        (out / pathlib.Path(n).name).write_bytes(z.read(n))
EOF
        rm -f "$whl"
        rm -rf "$cub" && mv "$cub.tmp" "$cub"
    fi
    extra+=("-DCMAKE_CUDA_FLAGS=-I$cub/include" "-DCMAKE_CXX_FLAGS=-I$cub/include")
fi
# Nothing is linked: these paths only give CMake its CUDA::cublas/cuda_driver targets on a
# machine without the cuBLAS libraries or a driver (libcuda.so).
nl="$cache/cuda-check/not-linked"
extra+=("-DCUDA_cublas_LIBRARY=$nl/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$nl/libcublasLt.so"
        "-DCUDA_cuda_driver_LIBRARY=$nl/libcuda.so")

# 3. configure (Makefiles: they have one rule per object file) and compile the objects
build_dir="${CUDA_CHECK_BUILD:-$cache/cuda-check/build-sm$arch}"
launcher=()
if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
              -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
t0=$(date +%s)
cmake -S "$llama" -B "$build_dir" -G "Unix Makefiles" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF "${launcher[@]}" "${extra[@]}" > "$build_dir.configure.log" 2>&1 \
    || { tail -n 30 "$build_dir.configure.log" >&2; die "cmake configure failed (log: $build_dir.configure.log)"; }
for obj in "${OBJECTS[@]}"; do
    t1=$(date +%s)
    nice -n 10 make -C "$build_dir/ggml/src/ggml-cuda" -j"$jobs" "$obj" \
        || die "nvcc failed on ${obj%.o} (sm_$arch)"
    echo "cuda-check: compiled ${obj%.o} in $(( $(date +%s) - t1 )) s"
done
echo "cuda-check: OK, ${#OBJECTS[@]} objects for sm_$arch in $(( $(date +%s) - t0 )) s (build dir $build_dir)"
