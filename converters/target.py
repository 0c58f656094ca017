"""Hugging Face target checkpoint -> GGUF (-> quantized GGUF), with upstream's own converter.

`convert_target(hf_dir, out)` runs `convert_hf_to_gguf.py` from the pinned llama.cpp source
(the one our patched llama-cpp-python is built from, so the GGUF it writes is exactly what that
build loads) in a subprocess with this interpreter, then quantizes with `llama_model_quantize`
(llama-cpp-python's binding of the same build). Types the converter writes natively (f32, f16,
bf16, q8_0) skip the quantize step; every other type converts to f16 first.

Nothing is fetched: the tokenizer and weights come from `hf_dir`, and the hub is kept offline.
The output appears only when complete (temp file + os.replace).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from blockspec.runtime.errors import BlockspecError

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
# written by convert_hf_to_gguf.py itself; everything else goes through llama_model_quantize
NATIVE_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
QUANT_TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m",
               "q5_k_s", "q5_k_m", "q6_k", "iq4_nl", "iq4_xs")
OUTTYPES = NATIVE_OUTTYPES + QUANT_TYPES


def _cache_root() -> Path:
    return Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec"))


def llama_source() -> Path:
    """The pinned llama.cpp source tree holding convert_hf_to_gguf.py.

    $BLOCKSPEC_LLAMA_SRC if set; else a tree `make build` unpacked under the cache; else the
    converter's files extracted from the cached sdist. BlockspecError when none is there."""
    env = os.environ.get("BLOCKSPEC_LLAMA_SRC")
    if env:
        src = Path(env)
        if not (src / "convert_hf_to_gguf.py").is_file():
            raise BlockspecError(f"BLOCKSPEC_LLAMA_SRC={env} has no convert_hf_to_gguf.py")
        return src
    root = _cache_root()
    sub = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp"
    for cand in sorted(root.glob(f"src/*/{sub}")):
        if (cand / "convert_hf_to_gguf.py").is_file():
            return cand
    sdist = root / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    dest = root / "convert-src"
    if (dest / sub / "convert_hf_to_gguf.py").is_file():
        return dest / sub
    if not sdist.is_file():
        raise BlockspecError(f"the pinned llama.cpp source is not under {root} (run `make build` first, "
                             "or set BLOCKSPEC_LLAMA_SRC to a llama.cpp checkout of the pinned version)")
    tmp = root / f"convert-src.tmp{os.getpid()}"
    wanted = (f"{sub}/convert_hf_to_gguf.py", f"{sub}/conversion/", f"{sub}/gguf-py/")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(wanted)]
        tf.extractall(tmp, members=members, filter="data")
    os.replace(tmp, dest)  # a half-extracted tree never looks ready
    return dest / sub


def _check_hf_dir(hf_dir: Path) -> None:
    if not hf_dir.is_dir():
        raise BlockspecError(f"{hf_dir} is not a directory (expected a Hugging Face checkpoint)")
    if not (hf_dir / "config.json").is_file():
        raise BlockspecError(f"{hf_dir} has no config.json (expected a Hugging Face checkpoint)")
    if not any(hf_dir.glob("*.safetensors")) and not any(hf_dir.glob("*.bin")):
        raise BlockspecError(f"{hf_dir} has no *.safetensors weights")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"blockspec convert: {msg}", file=sys.stderr, flush=True)


def run_convert_hf(hf_dir: Path, out: Path, outtype: str, progress: bool = True, extra: list[str] | None = None) -> None:
    """convert_hf_to_gguf.py HF_DIR --outfile OUT --outtype OUTTYPE in a subprocess; its log
    streams to stderr when `progress`; a failure raises BlockspecError with its last error line."""
    src = llama_source()
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
           "--outtype", outtype, *(extra or [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("NO_LOCAL_GGUF", None)  # the script must use the pinned tree's gguf-py, not pip's
    lines: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if progress:
            print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
    if proc.wait() != 0:
        err = next((ln for ln in reversed(lines) if "Error" in ln or "ERROR" in ln), lines[-1] if lines else "")
        if err.startswith("ERROR:"):  # logging's "ERROR:hf-to-gguf:message"
            err = err.split(":", 2)[-1]
        raise BlockspecError(f"convert_hf_to_gguf.py failed on {hf_dir}: {err.strip() or f'exit {proc.returncode}'}")


def quantize(src: Path, out: Path, qtype: str, threads: int = 0) -> None:
    """llama_model_quantize(src -> out) to `qtype` (a name in QUANT_TYPES)."""
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype.upper()}", None)
    if ftype is None:
        raise BlockspecError(f"llama-cpp-python has no quantization type {qtype!r}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads or int(os.environ.get("BLOCKSPEC_THREADS", 0)) or (os.cpu_count() or 1)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise BlockspecError(f"llama_model_quantize({src.name} -> {qtype}) failed with code {rc}")


def convert_target(hf_dir: str | os.PathLike, out_path: str | os.PathLike, quantize_type: str = "q8_0",
                   progress: bool = True, threads: int = 0) -> Path:
    """HF checkpoint dir -> GGUF at `out_path` of type `quantize_type` (see OUTTYPES)."""
    hf_dir, out = Path(hf_dir), Path(out_path)
    qt = quantize_type.lower()
    if qt not in OUTTYPES:
        raise BlockspecError(f"unknown type {quantize_type!r} (choose from {', '.join(OUTTYPES)})")
    _check_hf_dir(hf_dir)
    if not out.parent.is_dir():
        raise BlockspecError(f"output directory {out.parent} does not exist")
    t0 = time.time()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    tmp_f16 = out.with_name(f".{out.name}.f16.tmp{os.getpid()}")
    try:
        if qt in NATIVE_OUTTYPES:
            _say(progress, f"converting {hf_dir} -> {qt} with upstream convert_hf_to_gguf.py")
            run_convert_hf(hf_dir, tmp, qt, progress)
        else:
            _say(progress, f"converting {hf_dir} -> f16 with upstream convert_hf_to_gguf.py")
            run_convert_hf(hf_dir, tmp_f16, "f16", progress)
            _say(progress, f"quantizing to {qt} with llama_model_quantize")
            quantize(tmp_f16, tmp, qt, threads)
        os.replace(tmp, out)
    finally:
        for p in (tmp, tmp_f16):
            p.unlink(missing_ok=True)
    _say(progress, f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB, {qt}) in {time.time() - t0:.1f}s")
    return out
