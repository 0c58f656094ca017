"""Build upstream llama.cpp's own command-line tools from the SAME patched source as our wheel.

    python ggml_patches/build_tools.py [--backend cpu|cuda|hip|vulkan] [--cmake-arg -DX=Y ...]
                                       [--force] [--print-bin-dir]

`blockspec bench` runs upstream's speculative decoding (`llama-speculative-simple`: n-gram,
draft-model and DFlash drafting; `llama-lookup`: lookup decoding with a static n-gram cache) as
peers of our methods. A fair comparison needs the same
llama.cpp commit, the same patches and the same ggml CPU flags as the wheel our engine runs on,
so this reuses build.py's sdist, patch list and cmake flags; it only switches on the example/tool
targets and links them statically (the binaries then stand alone in their cache dir).

Output: $BLOCKSPEC_CACHE/tools/<key>/bin/{llama-speculative-simple, llama-simple, llama-lookup}, where <key> is
the wheel's build key (build.py --print-key) for the same backend and flags: the bench finds the
tools that match the installed wheel by reading llama_cpp/blockspec_build.json. A no-op when the
binaries are present. ccache and a persistent build dir per flag set make rebuilds cheap.

Stdlib only, like build.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import build  # ggml_patches/build.py: the wheel's pin, patches and flags (same directory)

TOOLS = ["llama-speculative-simple", "llama-simple", "llama-lookup"]

# The wheel disables every llama.cpp target except the libraries; the tools need common + examples.
# Static linking so `bin/` is self-contained; no curl/openssl (we never download anything).
TOOL_TOGGLES = ["-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
                "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                "-DCMAKE_BUILD_TYPE=Release"]


def tools_dir(key: str) -> Path:
    return build.cache_root() / "tools" / key


def bin_dir(key: str) -> Path:
    return tools_dir(key) / "bin"


def present(key: str) -> bool:
    return all((bin_dir(key) / t).is_file() for t in TOOLS)


def tool_flags(wheel_flags: list[str]) -> list[str]:
    """The wheel's flags with the target switches replaced: ggml/llama compile flags stay identical."""
    toggled = {f.split("=")[0] for f in TOOL_TOGGLES}
    return [f for f in wheel_flags if f.split("=")[0] not in toggled] + TOOL_TOGGLES


def build_tools(key: str, wheel_flags: list[str]) -> Path:
    sdist = build.fetch_sdist()
    fk = build.flags_key(wheel_flags)
    src = build.unpack_and_patch(sdist, build.cache_root() / "tools-src" / fk)
    llama = src / "vendor" / "llama.cpp"
    build_dir = build.cache_root() / "tools-build" / fk
    flags = tool_flags(wheel_flags)
    env = dict(os.environ)
    if shutil.which("ccache"):
        flags += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        if "-DGGML_CUDA=ON" in flags:
            flags.append("-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
        env.setdefault("CCACHE_DIR", str(build.cache_root() / "ccache"))
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    out = tools_dir(key)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build.log"
    build.log(f"configuring tools (flags: {' '.join(flags)}); log: {log_path}")
    t0 = time.time()
    jobs = env.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    with open(log_path, "w") as logf:
        for cmd in (["cmake", "-S", str(llama), "-B", str(build_dir), *gen, *flags],
                    ["cmake", "--build", str(build_dir), "-j", jobs, "--target", *TOOLS]):
            logf.write("$ " + " ".join(cmd) + "\n")
            logf.flush()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                logf.write(line)
                m = build.PROGRESS.search(line)
                if m:
                    print(f"\r[blockspec-build] compiling tools {m.group(0)}", end="", file=sys.stderr, flush=True)
            if proc.wait() != 0:
                print(file=sys.stderr)
                logf.flush()
                tail = log_path.read_text().splitlines()[-15:]
                raise build.BuildError(f"tools build failed ({cmd[1]}); see {log_path}\n" + "\n".join(tail))
    print(file=sys.stderr)
    # copy into a temp dir, then rename: a half-copied bin/ never looks present
    tmp = out / "bin.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for t in TOOLS:
        shutil.copy2(build_dir / "bin" / t, tmp / t)
    shutil.rmtree(bin_dir(key), ignore_errors=True)
    os.replace(tmp, bin_dir(key))
    build.log(f"built {', '.join(TOOLS)} in {time.time() - t0:.0f} s -> {bin_dir(key)}")
    return bin_dir(key)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=os.environ.get("BLOCKSPEC_BACKEND", "cpu"), choices=list(build.BACKEND_FLAGS))
    ap.add_argument("--cmake-arg", action="append", default=[], help="extra -D flag (repeatable)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the binaries exist")
    ap.add_argument("--print-bin-dir", action="store_true", help="print where the binaries go and exit")
    args = ap.parse_args(argv)

    extra = args.cmake_arg + os.environ.get("BLOCKSPEC_CMAKE_ARGS", "").split()
    try:
        wheel_flags = build.cmake_flags(args.backend, extra)
        key = build.build_key(wheel_flags)
        if args.print_bin_dir:
            print(bin_dir(key))
            return 0
        if present(key) and not args.force:
            build.log(f"upstream tools [{key}] already built: {bin_dir(key)}")
            return 0
        build_tools(key, wheel_flags)
    except build.BuildError as e:
        build.log(f"error: {e}")
        return 1
    except subprocess.CalledProcessError as e:
        build.log(f"error: command failed (exit {e.returncode}): {' '.join(map(str, e.cmd))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
