"""The patched build: cache key, patch failures, and no rebuild when nothing changed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO


def _build_module():
    spec = importlib.util.spec_from_file_location("bs_build", REPO / "ggml_patches" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_key_depends_on_patches_and_flags(tmp_path, monkeypatch):
    b = _build_module()
    flags = b.cmake_flags("cpu", [])
    k = b.build_key(flags)
    assert k == b.build_key(list(flags))
    assert k != b.build_key(b.cmake_flags("cuda", []))
    assert k != b.build_key(flags + ["-DGGML_CUDA_F16=ON"])
    # a changed patch changes the key
    for p in b.patch_files():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(b, "PATCH_DIR", tmp_path)
    assert b.build_key(flags) == k
    first = sorted(tmp_path.glob("*.patch"))[0]
    first.write_bytes(first.read_bytes() + b"\n")
    assert b.build_key(flags) != k


def test_installed_library_is_the_cached_build():
    import llama_cpp

    b = _build_module()
    stamp = json.loads(Path(llama_cpp.__file__).with_name("blockspec_build.json").read_text())
    assert stamp["key"] == b.build_key(b.cmake_flags("cpu", []))
    assert stamp["patches"] == [p.name for p in b.patch_files()]


def test_second_build_is_a_noop():
    t0 = time.time()
    r = subprocess.run([sys.executable, str(REPO / "ggml_patches" / "build.py"), "--python", sys.executable],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "already installed" in r.stderr
    assert time.time() - t0 < 60


def test_bad_patch_stops_with_its_name(tmp_path, monkeypatch):
    b = _build_module()
    sdist = b.cache_root() / "sdist" / b.SDIST
    if not sdist.exists():
        pytest.skip("pinned sdist not in the cache")
    for p in b.patch_files():
        (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / "0099-does-not-apply.patch").write_text(
        "--- a/src/llama.cpp\n+++ b/src/llama.cpp\n@@ -1,3 +1,3 @@\n-this line\n+is not\n there\n")
    monkeypatch.setattr(b, "PATCH_DIR", tmp_path)
    with pytest.raises(b.BuildError, match="0099-does-not-apply.patch"):
        b.unpack_and_patch(sdist, tmp_path / "src")
