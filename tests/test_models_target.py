"""The torch target loaded from GGUF: loader round trips (tiny random qwen3/qwen2/llama written
with gguf.GGUFWriter), rope layouts, and parity with llama.cpp on SmolLM2-135M Q4_1."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from blockspec.models import target as tgt  # noqa: E402
from fixtures_target import write_tiny_gguf  # noqa: E402
from blockspec.models.parity import (PARITY_MIN_TOKENS, format_figures, parity_figures, real_text_tokens,  # noqa: E402
                                     runtime_reference)

TINY = dict(dim=64, n_layer=3, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=96, vocab_size=101,
            rope_base=10000.0, norm_eps=1e-6)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_tiny_gguf_round_trip(tmp_path, arch):
    args = tgt.ModelArgs(arch=arch, tied_embeddings=(arch != "qwen3"), **TINY)
    path = tmp_path / f"tiny-{arch}.gguf"
    state = write_tiny_gguf(path, args, seed=3)
    if arch == "qwen3":
        assert any(k.endswith("attn.q_norm.weight") for k in state)
    if arch == "qwen2":
        assert any(k.endswith("attn.wq.bias") for k in state)
    m = tgt.load_target(path, emulate_ggml=False)  # exact fp32 compare with the reference
    assert m.args.arch == arch and m.args.n_layer == 3 and m.args.head_dim == 16
    assert m.args.tied_embeddings == (arch != "qwen3")
    ref = tgt.TargetModel(args)
    ref.load_state_dict(state)
    toks = torch.randint(0, 101, (2, 9))
    lg, st = m(toks, layers=[0, 1, 3])
    lr, sr = ref(toks, layers=[0, 1, 3])
    torch.testing.assert_close(lg, lr)
    assert set(st) == {0, 1, 3} and st[0].shape == (2, 9, 64)
    torch.testing.assert_close(st[3], sr[3])
    # logits from state n_layer equal the forward's logits (drafter data uses this path)
    torch.testing.assert_close(m.logits(st[3]), lg, atol=1e-5, rtol=1e-5)
    # llama.cpp's rounding (f16 flash attention operands; F32 weights keep f32 activations) stays
    # close to the fp32 reference, in the default and in the exact emulation
    for kw in (dict(), dict(exact=True)):
        le, se = tgt.load_target(path, **kw)(toks, layers=[3])
        torch.testing.assert_close(le, lr, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(se[3], sr[3], atol=2e-2, rtol=2e-2)
    # causal: a later token never changes earlier logits
    toks2 = toks.clone()
    toks2[:, -1] = (toks2[:, -1] + 1) % 101
    torch.testing.assert_close(m(toks2)[0][:, :-1], lg[:, :-1])


def test_unknown_arch_is_rejected(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="mamba"):
        tgt.load_target(tmp_path / "x.gguf")


def _hf_permute(w, n_head):
    # the row permutation convert_hf_to_gguf applies to llama Q/K (written from its description)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_normal_rope_on_permuted_weights_equals_neox_on_hf_weights():
    """Why the torch llama applies rope in adjacent-pair mode to GGUF Q/K: on the permuted rows it
    gives exactly HF's rotate_half attention scores."""
    from blockspec.models.common import apply_rope, rope_cos_sin

    torch.manual_seed(0)
    nh, nkv, D, Hd, T = 4, 2, 16, 64, 7
    wq, wk = torch.randn(nh * D, Hd), torch.randn(nkv * D, Hd)
    x = torch.randn(1, T, Hd)
    cos, sin = rope_cos_sin(torch.arange(T)[None], D, 10000.0)

    def scores(wq, wk, neox):
        q = apply_rope((x @ wq.T).view(1, T, nh, D).transpose(1, 2), cos, sin, neox)
        k = apply_rope((x @ wk.T).view(1, T, nkv, D).transpose(1, 2), cos, sin, neox)
        return q @ k.repeat_interleave(nh // nkv, 1).transpose(-1, -2)

    torch.testing.assert_close(scores(_hf_permute(wq, nh), _hf_permute(wk, nkv), False),
                               scores(wq, wk, True), atol=1e-4, rtol=1e-4)


def test_default_layers():
    from blockspec.models.common import default_layers

    assert default_layers(30, 3) == [1, 15, 29]
    assert default_layers(30, 5) == [1, 8, 15, 22, 29]


# --- parity with llama.cpp: what the runtime computes ---------------------------------------------
# Stated tolerances (relative RMS error of a layer state against llama.cpp's tap):
# exact=True reproduces the CPU kernels; measured 0 (bit-identical) at every layer on this build.
EXACT_TAP_REL_RMS_TOL = 1e-5
EXACT_MIN_TOP1 = 0.99
# default emulate_ggml: cheap roundings only; the f32 summation order of torch's matmuls flips
# q8/f16 roundings now and then, measured ~2e-3 (early layers) .. 3e-2 (last layer).
FAST_TAP_REL_RMS_TOL = 0.05
FAST_MIN_TOP1 = 0.94

@pytest.fixture(scope="module")
def smollm2_parity():
    try:
        from blockspec.runtime.llama import ext as llama_ext
        from blockspec.runtime.format.modelfile import bundled_model_path

        llama_ext.check_abi()
        path = str(bundled_model_path())
    except Exception as e:  # noqa: BLE001 - no patched llama.cpp or bundled model here
        pytest.skip(f"patched llama.cpp with the bundled SmolLM2 unavailable: {e}")
    try:
        tokens = real_text_tokens(path)
    except ImportError as e:
        pytest.skip(f"training-text packages unavailable: {e}")
    ref_logits, ref_taps = runtime_reference(path, tokens)
    # the runtime's other mode, one token per decode, gives the same bits (batch invariance)
    from blockspec.runtime.llama.target import Target, TargetConfig

    with Target(path, TargetConfig(n_ctx=1024, n_batch=64)) as t:
        for i, tok in enumerate(tokens[:32]):
            t.decode([tok], [i])
            np.testing.assert_array_equal(t.logits_row(-1), ref_logits[i], err_msg=f"position {i}")
    return path, tokens, ref_logits, ref_taps


@pytest.mark.heavy  # ~2 min on one core: exact=True reproduces every kernel step in torch
def test_smollm2_exact_parity_with_runtime(smollm2_parity):
    path, tokens, ref_logits, ref_taps = smollm2_parity
    f = parity_figures(tgt.load_target(path, exact=True), tokens, ref_logits, ref_taps)
    print(format_figures("exact=True", f))
    assert f["n"] >= PARITY_MIN_TOKENS
    assert f["top1"] >= EXACT_MIN_TOP1
    for lid, e in f["layers"].items():
        assert e["rel_rms"] <= EXACT_TAP_REL_RMS_TOL, (lid, e)


@pytest.mark.heavy  # ~20 s
def test_smollm2_default_emulation_parity_with_runtime(smollm2_parity):
    """The default (fast) load: near-ties may flip, decisive positions agree."""
    path, tokens, ref_logits, ref_taps = smollm2_parity
    f = parity_figures(tgt.load_target(path), tokens, ref_logits, ref_taps)
    print(format_figures("emulate_ggml=True", f))
    assert f["top1"] >= FAST_MIN_TOP1
    assert f["top1_decisive"] >= 0.99
    for lid, e in f["layers"].items():
        assert e["rel_rms"] < FAST_TAP_REL_RMS_TOL, (lid, e)


def test_tiny_q4_1_exact_parity_with_runtime(tmp_path):
    """exact=True on a tiny random llama with Q4_1 blocks: logits and every layer state equal the
    runtime's (flash attention, verify-sized batches) bit for bit, or nearly (stated tolerance)."""
    try:
        from blockspec.runtime.llama import ext as llama_ext
        from blockspec.runtime.format.modelfile import bundled_model_path

        llama_ext.check_abi()
        tok_src = bundled_model_path()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"patched llama.cpp with the bundled SmolLM2 unavailable: {e}")
    args = tgt.ModelArgs(arch="llama", dim=128, n_layer=3, n_head=4, n_kv_head=2, head_dim=32, ffn_dim=256,
                         vocab_size=49152, rope_base=10000.0, norm_eps=1e-5)
    path = tmp_path / "tiny-q4_1.gguf"
    write_tiny_gguf(path, args, seed=5, tokenizer_from=tok_src, quant="Q4_1")
    tokens = [int(t) for t in torch.randint(0, 49152, (90,), generator=torch.Generator().manual_seed(1))]
    ref_logits, ref_taps = runtime_reference(path, tokens, layers=[0, 1, 2])
    f = parity_figures(tgt.load_target(path, exact=True), tokens, ref_logits, ref_taps)
    print(format_figures("tiny Q4_1 exact=True", f))
    assert f["top1"] == 1.0
    for lid, e in f["layers"].items():
        assert e["rel_rms"] <= EXACT_TAP_REL_RMS_TOL, (lid, e)
