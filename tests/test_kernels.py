"""Patch 0011: Q4_1 and Q8_0 matmuls in register tiles (x86 AVX2). Each result is computed with
exactly ggml's vec_dot operations in vec_dot's order, so a row's logits stay bit-identical whether
it is decoded alone or in a batch of any size the batch-invariant mode covers."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the tiles are x86 AVX2 code")


def test_the_tiles_are_in_the_build():
    import llama_cpp

    lib = next((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    syms = subprocess.run(["nm", "-D", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "ggml_mul_mat_q4_1_q8_1_tiles" in syms and "ggml_mul_mat_q8_0_q8_0_tiles" in syms


@pytest.mark.parametrize("threads", [1, 2])
def test_batched_rows_equal_rows_alone_up_to_the_invariant_bound(smollm2_path, threads):
    # SmolLM2's layers are Q4_1 and its output projection Q8_0: every batch of 2..63 rows (odd
    # sizes leave single-column tiles) equals the rows alone
    from blockspec.runtime.llama.target import PROBE_MAX, Target, TargetConfig, probe_exact_batch_limit

    with Target(smollm2_path, TargetConfig(n_ctx=512, n_threads=threads)) as t:
        assert probe_exact_batch_limit(t) == PROBE_MAX
