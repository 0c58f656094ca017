"""The VM's CPUs report AMX but do not enable it: our build must never execute AMX code."""

from __future__ import annotations

from blockspec.runtime.llama.target import safe_extra_bufts, system_info


def test_build_has_no_amx_or_avx512():
    info = system_info()
    assert "AMX_INT8 = 1" not in info
    assert "AVX512 = 1" not in info


def test_load_and_decode_with_default_loader(smollm2):
    # the default loader (extra buffer types on, since the build has no AMX) loads and decodes
    assert safe_extra_bufts()
    smollm2.clear()
    toks = smollm2.tokenize("Hello, world")
    logits = smollm2.prefill(toks)
    assert logits.shape == (smollm2.n_vocab,) and abs(float(logits.max())) > 0
