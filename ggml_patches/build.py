"""Build llama-cpp-python 0.3.36 with blockspec's patches and install it.

    python ggml_patches/build.py [--backend cpu|cuda|hip|vulkan] [--cmake-arg -DX=Y ...]
                                 [--python .venv/bin/python] [--force] [--print-key]

Steps, each skipped when its result already exists:
  1. fetch the pinned sdist with pip and check its sha256;
  2. unpack it and apply ggml_patches/NNNN-*.patch in order to vendor/llama.cpp
     (a patch that does not apply stops the build and names the file);
  3. build a wheel with scikit-build-core (ccache + a persistent build dir per flag set,
     so editing one patch recompiles only what it touches);
  4. install the wheel into the given interpreter's environment.

The wheel is cached outside the work tree under $BLOCKSPEC_CACHE (default
~/.cache/blockspec) keyed by upstream version + patch hash + cmake flags, so a second
`make test` on the same machine installs in seconds and never recompiles.

Stdlib only: this runs before the project environment has anything in it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

UPSTREAM = "llama-cpp-python"
VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

PROGRESS = re.compile(r"\[\s*\d+(/\d+|%)\]")
PATCH_DIR = Path(__file__).resolve().parent

# These CPUs report AMX but the VM does not enable it: a -march=native build (or
# llama.cpp's AMX repacking) dies with "Illegal instruction". A portable x86-64
# AVX2/FMA/F16C build with AVX512 and AMX off runs everywhere we target.
CPU_FLAGS = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
]
COMMON_FLAGS = ["-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF"]
BACKEND_FLAGS = {
    "cpu": [],
    # RTX: set CMAKE_CUDA_ARCHITECTURES for your card (e.g. 86 for RTX 30xx, 89 for 40xx).
    "cuda": ["-DGGML_CUDA=ON"],
    # AMD Strix Halo / Point (gfx1151 / gfx1150) through ROCm.
    "hip": ["-DGGML_HIP=ON", "-DAMDGPU_TARGETS=gfx1151;gfx1150"],
    "vulkan": ["-DGGML_VULKAN=ON"],
}


class BuildError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[blockspec-build] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec"))


def patch_files() -> list[Path]:
    return sorted(PATCH_DIR.glob("[0-9][0-9][0-9][0-9]-*.patch"))


def cmake_flags(backend: str, extra: list[str]) -> list[str]:
    if backend not in BACKEND_FLAGS:
        raise BuildError(f"unknown backend {backend!r}; choose one of {', '.join(BACKEND_FLAGS)}")
    return COMMON_FLAGS + CPU_FLAGS + BACKEND_FLAGS[backend] + list(extra)


def build_key(flags: list[str]) -> str:
    h = hashlib.sha256()
    h.update(f"{UPSTREAM}=={VERSION}:{SDIST_SHA256}\n".encode())
    for p in patch_files():
        h.update(p.name.encode() + b"\n" + p.read_bytes())
    h.update("\n".join(flags).encode())
    return h.hexdigest()[:16]


def flags_key(flags: list[str]) -> str:
    return hashlib.sha256("\n".join(flags).encode()).hexdigest()[:12]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist() -> Path:
    dest = cache_root() / "sdist"
    path = dest / SDIST
    if path.exists() and sha256_file(path) == SDIST_SHA256:
        return path
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading {UPSTREAM}=={VERSION} sdist with pip")
    tmp = dest / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                    "-d", str(tmp), f"{UPSTREAM}=={VERSION}"],
                   check=True, stdout=subprocess.DEVNULL)
    got = tmp / SDIST
    if not got.exists():
        raise BuildError(f"pip did not produce {SDIST} in {tmp}")
    digest = sha256_file(got)
    if digest != SDIST_SHA256:
        raise BuildError(f"{SDIST}: sha256 {digest} does not match the pinned {SDIST_SHA256}")
    os.replace(got, path)
    shutil.rmtree(tmp, ignore_errors=True)
    return path


def unpack_and_patch(sdist: Path, src_parent: Path) -> Path:
    """Fresh source tree with every patch applied. Unchanged files keep the archive's
    mtimes, so the persistent build dir recompiles only what the patches touched."""
    shutil.rmtree(src_parent, ignore_errors=True)
    src_parent.mkdir(parents=True)
    with tarfile.open(sdist) as tf:
        tf.extractall(src_parent, filter="tar")
    src = src_parent / f"llama_cpp_python-{VERSION}"
    llama = src / "vendor" / "llama.cpp"
    for patch in patch_files():
        res = subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch",
                              "-i", str(patch)], cwd=llama, capture_output=True, text=True)
        if res.returncode != 0:
            detail = (res.stdout + res.stderr).strip().splitlines()
            raise BuildError(f"patch {patch.name} does not apply to llama.cpp of {UPSTREAM} {VERSION}: "
                             + (detail[-1] if detail else f"exit {res.returncode}"))
        log(f"applied {patch.name}")
    return src


def build_wheel(src: Path, flags: list[str], build_dir: Path, out_dir: Path) -> Path:
    env = dict(os.environ)
    launcher = []
    if shutil.which("ccache"):
        launcher = ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
        if "-DGGML_CUDA=ON" in flags:
            launcher.append("-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache")
        env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
    env["CMAKE_ARGS"] = " ".join(flags + launcher)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp_out = out_dir / "tmp"
    shutil.rmtree(tmp_out, ignore_errors=True)
    log_path = out_dir / "build.log"
    log(f"building (CMAKE_ARGS={env['CMAKE_ARGS']}); log: {log_path}")
    t0 = time.time()
    with open(log_path, "w") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_out), "-v",
             "-C", f"build-dir={build_dir}", str(src)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            logf.write(line)
            m = PROGRESS.search(line)  # ninja "[44/141]" or make "[ 42%]"
            if m:
                print(f"\r[blockspec-build] compiling {m.group(0)}", end="", file=sys.stderr, flush=True)
        rc = proc.wait()
    print(file=sys.stderr)
    if rc != 0:
        tail = log_path.read_text().splitlines()[-15:]
        raise BuildError(f"wheel build failed (exit {rc}); see {log_path}\n" + "\n".join(tail))
    wheels = list(tmp_out.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"expected one wheel in {tmp_out}, found {wheels}")
    final = out_dir / wheels[0].name
    os.replace(wheels[0], final)  # atomic: a half-built wheel never looks cached
    shutil.rmtree(tmp_out, ignore_errors=True)
    log(f"built {final.name} in {time.time() - t0:.0f} s")
    return final


def installed_key(python: str) -> str | None:
    res = subprocess.run([python, "-c", "import llama_cpp, pathlib; "
                          "p = pathlib.Path(llama_cpp.__file__).with_name('blockspec_build.json'); "
                          "print(p.read_text() if p.exists() else '{}')"],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return None
    try:
        return json.loads(res.stdout).get("key")
    except json.JSONDecodeError:
        return None


def install(python: str, wheel: Path, key: str, flags: list[str]) -> None:
    log(f"installing {wheel.name} into {python}")
    # replace whatever llama-cpp-python is there, then add only its missing dependencies
    subprocess.run([python, "-m", "pip", "install", "--no-deps", "--force-reinstall", "-q", str(wheel)], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", str(wheel)], check=True)
    stamp = json.dumps({"key": key, "version": VERSION, "flags": flags,
                        "patches": [p.name for p in patch_files()]}, indent=1)
    res = subprocess.run([python, "-c", "import llama_cpp, pathlib, sys; "
                          "pathlib.Path(llama_cpp.__file__).with_name('blockspec_build.json')"
                          ".write_text(sys.stdin.read())"], input=stamp, text=True)
    if res.returncode != 0:
        raise BuildError("installed wheel does not import: llama_cpp failed to load")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default=os.environ.get("BLOCKSPEC_BACKEND", "cpu"), choices=list(BACKEND_FLAGS))
    ap.add_argument("--cmake-arg", action="append", default=[], help="extra -D flag (repeatable)")
    ap.add_argument("--python", default=sys.executable, help="interpreter whose environment gets the wheel")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    ap.add_argument("--wheel-only", action="store_true", help="build/cache the wheel, do not install")
    args = ap.parse_args(argv)

    extra = args.cmake_arg + os.environ.get("BLOCKSPEC_CMAKE_ARGS", "").split()
    try:
        flags = cmake_flags(args.backend, extra)
        key = build_key(flags)
        if args.print_key:
            print(key)
            return 0
        out_dir = cache_root() / "wheels" / key
        wheel = next(iter(out_dir.glob("llama_cpp_python-*.whl")), None)
        if wheel is not None and not args.force:
            if not args.wheel_only and installed_key(args.python) == key:
                log(f"patched llama-cpp-python {VERSION} [{key}] already installed")
                return 0
            log(f"using cached wheel [{key}]")
        else:
            sdist = fetch_sdist()
            fk = flags_key(flags)
            src = unpack_and_patch(sdist, cache_root() / "src" / fk)
            wheel = build_wheel(src, flags, cache_root() / "build" / fk, out_dir)
        if not args.wheel_only:
            install(args.python, wheel, key, flags)
    except BuildError as e:
        log(f"error: {e}")
        return 1
    except subprocess.CalledProcessError as e:
        log(f"error: command failed (exit {e.returncode}): {' '.join(map(str, e.cmd))}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
