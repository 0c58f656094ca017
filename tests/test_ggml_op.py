"""GGML_OP_BLOCK_SHIFT (patch 0005): SpecBlock's layer-wise shift as one ggml op.

Runs upstream's test-backend-ops (and our test-block-shift beside it) built from the patched
source; skipped unless BLOCKSPEC_TEST_BACKEND_OPS names that binary, e.g.

    BLOCKSPEC_TEST_BACKEND_OPS=/path/to/build/bin/test-backend-ops pytest -m heavy tests/test_ggml_op.py

test-backend-ops compares a backend with the CPU reference: with `-b CPU` the CPU backend itself
(so the composed cases check op - (view+pad+concat) == 0 exactly), without -b every non-CPU backend
(CUDA, ...; none on a CPU-only build). test-block-shift checks the CPU op bit for bit against its
definition and against the same result built from existing ops.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

ENV = "BLOCKSPEC_TEST_BACKEND_OPS"


@pytest.fixture(scope="module")
def backend_ops() -> Path:
    path = os.environ.get(ENV)
    if not path:
        pytest.skip(f"{ENV} not set (path of a test-backend-ops built from the patched source)")
    exe = Path(path)
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        pytest.fail(f"{ENV}={path} is not an executable file")
    return exe


def _run(*cmd: str | Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("BLOCKSPEC_THREADS", "1")})


def _passed(out: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+)/(\d+) tests passed", out)]


def test_block_shift_cases_on_cpu(backend_ops):
    """`-b CPU` runs the cases on the CPU backend against the CPU reference: the plain cases
    then compare the op with itself, and the composed ones check op - (view+pad+concat) == 0."""
    r = _run(backend_ops, "-o", "BLOCK_SHIFT", "-b", "CPU")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "BLOCK_SHIFT(" in out, "test-backend-ops has no BLOCK_SHIFT case (unpatched build?)"
    counts = _passed(out)
    assert counts and all(p == t and t > 0 for p, t in counts), out[-3000:]
    assert re.search(r"composed=1\): .*OK", out), out[-3000:]


def test_block_shift_matches_cpu_on_every_other_backend(backend_ops):
    """Without -b: every non-CPU backend (CUDA, ...) against the CPU; a CPU-only build has none."""
    r = _run(backend_ops, "-o", "BLOCK_SHIFT")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert all(p == t for p, t in _passed(out)), out[-3000:]


def test_cpu_op_equals_definition_and_composed_ops(backend_ops):
    exe = backend_ops.with_name("test-block-shift")
    if not exe.is_file():
        pytest.skip(f"no test-block-shift beside {backend_ops}")
    r = _run(exe)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    m = re.search(r"(\d+)/(\d+) block_shift cases passed", out)
    assert m and m.group(1) == m.group(2) and int(m.group(2)) > 0, out[-3000:]
