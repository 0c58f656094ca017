"""Converters: HF targets through upstream's convert_hf_to_gguf.py (+ llama_model_quantize) against
the HF model's own logits; BlockPilot GGUF round trip; the upstream-dflash export checked by
upstream's own loader; the z-lab DFlash mapping against a direct computation of DFlash's forward.

Every model here is tiny and random, built locally (no hub downloads): a 4-layer Qwen3 and Llama of
width 64 with a SentencePiece tokenizer trained on a few sentences."""

from __future__ import annotations

import io
import json
import math
import os

import numpy as np
import pytest


torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from blockspec.runtime.errors import BlockspecError  # noqa: E402
from blockspec.runtime.llama.target import Target, TargetConfig  # noqa: E402

TEXT = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small village, there lived a cat.",
        "Speculative decoding drafts a block of tokens and verifies them in one pass.",
        "def add(a, b):\n    return a + b"] * 20
VOCAB = 320
TOKENS = [1, 17, 200, 45, 99, 310, 5, 77, 150, 260, 33, 8]
HF = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
          rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_THREADS", "1")


def run_cli(*args: str):
    """`blockspec ARGS` in this process (click's runner): the commands as a user runs them, without
    paying a fresh interpreter's torch import per call."""
    from click.testing import CliRunner

    from blockspec.runtime.frontends.cli import cli

    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    r.returncode = r.exit_code
    return r


def _spm_model() -> bytes:
    spm = pytest.importorskip("sentencepiece")  # the `convert` extra; BlockPilot tests run without it
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_writer=buf, vocab_size=VOCAB, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0,
                                   pad_id=-1, num_threads=1, minloglevel=2)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """{"qwen3": dir, "llama": dir}: random HF checkpoints (safetensors) with a local tokenizer."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    tok = _spm_model()
    out = {}
    for name, cfg_cls, model_cls in [("qwen3", transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                     ("llama", transformers.LlamaConfig, transformers.LlamaForCausalLM)]:
        torch.manual_seed(0)
        d = root / name
        model_cls(cfg_cls(**HF)).save_pretrained(d, safe_serialization=True)
        (d / "tokenizer.model").write_bytes(tok)
        out[name] = d
    return out


def _hf_logits(d) -> np.ndarray:
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor([TOKENS])).logits[0].numpy()


def _gguf_logits(path) -> np.ndarray:
    with Target(path, TargetConfig(n_ctx=64)) as t:
        assert t.n_vocab == VOCAB
        t.decode(TOKENS, range(len(TOKENS)), logits=[True] * len(TOKENS))
        return np.stack([t.logits_row(i) for i in range(len(TOKENS))])


@pytest.fixture(scope="module")
def converted(hf_dirs, tmp_path_factory):
    """Both targets converted at once (each conversion is mostly a fresh interpreter importing torch
    and transformers, so the two overlap well): Qwen3 -> f32 through the CLI, Llama -> q5_1 through
    convert_target (upstream's converter to f16, then llama_model_quantize)."""
    import threading

    from blockspec.converters.target import convert_target

    root = tmp_path_factory.mktemp("gguf")
    qwen3, llama = root / "tiny-qwen3-f32.gguf", root / "tiny-llama-q5_1.gguf"
    err = []

    def bg():
        try:
            convert_target(hf_dirs["llama"], llama, quantize_type="q5_1", progress=False)
        except Exception as e:  # noqa: BLE001 - re-raised in the test thread
            err.append(e)

    th = threading.Thread(target=bg)
    th.start()
    r = run_cli("convert", "target", str(hf_dirs["qwen3"]), str(qwen3), "--quantize", "f32")
    th.join()
    assert r.returncode == 0, r.output[-2000:]
    assert "wrote" in r.stderr
    if err:
        raise err[0]
    return {"qwen3": qwen3, "llama": llama}


@pytest.fixture(scope="module")
def qwen3_f32(converted):
    return converted["qwen3"]


@pytest.fixture(scope="module")
def llama_q(converted):
    return converted["llama"]


def test_target_qwen3_f32_matches_hf(hf_dirs, qwen3_f32):
    ref, got = _hf_logits(hf_dirs["qwen3"]), _gguf_logits(qwen3_f32)
    assert gguf.GGUFReader(str(qwen3_f32)).fields["general.architecture"].contents() == "qwen3"
    # f32 weights; llama.cpp keeps K/V in f16, the only rounding on its side
    assert np.abs(got - ref).max() < 0.02
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_target_llama_quantized_matches_hf(hf_dirs, llama_q):
    r = gguf.GGUFReader(str(llama_q))
    assert r.fields["general.architecture"].contents() == "llama"
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_1"  # llama_model_quantize ran
    ref, got = _hf_logits(hf_dirs["llama"]), _gguf_logits(llama_q)
    # 5-bit weights move logits by ~0.1-1 on this random model: greedy agrees on most positions,
    # and where it does not, llama.cpp's pick is a near-tie in the HF logits
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.75
    picked = ref[np.arange(len(TOKENS)), got.argmax(-1)]
    assert (ref.max(-1) - picked <= 1.5).all()
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.95  # measured 0.973


def test_target_bad_input_one_line(tmp_path):
    r = run_cli("convert", "target", str(tmp_path), str(tmp_path / "x.gguf"))
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "config.json" in r.stderr
    assert not (tmp_path / "x.gguf").exists()


# ------------------------------------------------------------------------------------ blockpilot
def test_blockpilot_gguf_round_trip(tmp_path):
    from blockspec.converters.blockpilot import load_blockpilot_gguf, softmax_summary_np
    from blockspec.models import blockpilot as bp

    torch.manual_seed(0)
    model = bp.BlockPilot(bp.ModelArgs(top_k=6, hidden_dim=32, n_layer=3, base_block_size=8, spread=2))
    logits = torch.randn(64, 500) * 3
    model.set_feature_stats(bp.features(logits, 6))
    ckpt = bp.save_checkpoint(tmp_path / "bp", model, note="test")
    r = run_cli("convert", "blockpilot", str(ckpt), str(tmp_path / "bp.gguf"))
    assert r.returncode == 0, r.stderr
    np_model = load_blockpilot_gguf(tmp_path / "bp.gguf")
    assert np_model.block_sizes == [6, 7, 8, 9, 10] and np_model.top_k == 6
    feats_t = bp.features(logits, 6)
    np.testing.assert_allclose(softmax_summary_np(logits.numpy(), 6), feats_t.numpy(), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        ref = model(feats_t).numpy()
    np.testing.assert_allclose(np_model.scores(feats_t.numpy()), ref, rtol=1e-5, atol=1e-5)
    assert [np_model.choose(x) for x in logits.numpy()] == [model.choose(x) for x in logits]
    reader = gguf.GGUFReader(str(tmp_path / "bp.gguf"))
    assert reader.fields["general.architecture"].contents() == "blockpilot"
    assert {t.name for t in reader.tensors} >= {f"blockpilot.fc{i}.{k}" for i in range(4) for k in ("weight", "bias")}


def test_blockpilot_bad_file(tmp_path):
    from blockspec.converters.blockpilot import load_blockpilot_gguf

    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    with pytest.raises(BlockspecError, match="not a GGUF"):
        load_blockpilot_gguf(tmp_path / "x.gguf")


# ------------------------------------------------------------------------------- upstream dflash
def _dblast(n_layer=2, target_layers=(1, 3), block_size=4, seed=0, qk_norm=False):
    from blockspec.models.dblast import DBlast, ModelArgs

    torch.manual_seed(seed)
    m = DBlast(ModelArgs(dim=64, n_layer=n_layer, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=128,
                         vocab_size=VOCAB, target_layers=list(target_layers), target_dim=64,
                         block_size=block_size, norm_eps=1e-6, qk_norm=qk_norm))
    if qk_norm:  # norm weights off their init, so the export must carry them
        with torch.no_grad():
            for layer in m.layers:
                layer.attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.attn.k_norm.weight.uniform_(0.5, 1.5)
    return m


def test_upstream_dflash_export_loads_in_upstream(llama_q, tmp_path):
    import llama_cpp as ll

    from blockspec.converters.upstream_dflash import export_upstream_dflash
    from blockspec.models.target import dequantize_tensor

    model = _dblast()
    out = export_upstream_dflash(model, tmp_path / "dflash.gguf", target=llama_q, outtype="f32")
    r = gguf.GGUFReader(str(out))
    f = {k: r.fields[k].contents() for k in r.fields}
    assert f["general.architecture"] == "dflash"
    assert f["dflash.target_layers"] == [1, 3] and f["dflash.block_size"] == 4
    assert f["tokenizer.ggml.mask_token_id"] == VOCAB and len(f["tokenizer.ggml.tokens"]) == VOCAB + 1
    t = {x.name: x for x in r.tensors}
    assert [int(s) for s in t["token_embd.weight"].shape] == [64, VOCAB + 1]
    assert [int(s) for s in t["output.weight"].shape] == [64, VOCAB]
    assert t["d2t"].tensor_type.name == "I64" and (np.asarray(t["d2t"].data) == np.arange(VOCAB)).all()
    assert [int(s) for s in t["fc.weight"].shape] == [128, 64]
    assert not any("attn_q_norm" in n or "attn_k_norm" in n for n in t)  # no q/k norm: the patched graph skips it
    emb = dequantize_tensor(t["token_embd.weight"])
    np.testing.assert_array_equal(emb[VOCAB], model.mask_embedding.detach().numpy())
    np.testing.assert_allclose(emb[:VOCAB], dequantize_tensor(next(x for x in gguf.GGUFReader(str(llama_q)).tensors
                                                                    if x.name == "token_embd.weight")))
    np.testing.assert_allclose(dequantize_tensor(t["blk.1.attn_k.weight"]), model.layers[1].attn.wk.weight.detach().numpy())
    # upstream's own loader checks every required key and tensor shape of its dflash arch
    mdl = ll.llama_model_load_from_file(str(out).encode(), ll.llama_model_default_params())
    assert mdl, "upstream llama.cpp refused the dflash export"
    try:
        vocab = ll.llama_model_get_vocab(mdl)
        assert ll.llama_vocab_n_tokens(vocab) == VOCAB + 1 and ll.llama_vocab_mask(vocab) == VOCAB
        buf = (ll.ctypes.c_char * 64)()
        assert ll.llama_model_meta_val_str(mdl, b"general.architecture", buf, 64) > 0 and buf.value == b"dflash"
    finally:
        ll.llama_model_free(mdl)


def test_upstream_dflash_exports_categories(llama_q, tmp_path):
    """DBlast's category prior and expander go into the dflash layout as blockspec.category_* and
    load in the patched llama.cpp (0008); the graph itself is checked in tests/test_ggml_dflash.py."""
    import llama_cpp as ll

    from blockspec.converters.upstream_dflash import export_upstream_dflash
    from blockspec.models.dblast import DBlast

    a = _dblast().args
    a.n_categories = 3
    m = DBlast(a)
    out = export_upstream_dflash(m, tmp_path / "x.gguf", target=llama_q, outtype="f32")
    t = {x.name: x for x in gguf.GGUFReader(str(out)).tensors}
    assert [int(s) for s in t["blockspec.category_prior.weight"].shape] == [64, 3]
    assert [int(s) for s in t["blockspec.category_expander.weight"].shape] == [64, 3 * 64]
    np.testing.assert_array_equal(np.asarray(t["blockspec.category_expander.bias"].data),
                                  m.category_expander.bias.detach().numpy())
    mdl = ll.llama_model_load_from_file(str(out).encode(), ll.llama_model_default_params())
    assert mdl, "patched llama.cpp refused a DBlast export with categories"
    ll.llama_model_free(mdl)


# ------------------------------------------------------------------------------ z-lab DFlash HF
def _zlab_dir(tmp_path, qk_norm: bool, ids=(0, 2), mask_id=7):
    """A tiny DFlash-style HF checkpoint in z-lab's layout (names, config, target ids)."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    H, L, nh, nkv, hd, ff = 64, 2, 4, 2, 16, 128
    s = {"fc.weight": torch.randn(H, len(ids) * H) / math.sqrt(len(ids) * H),
         "hidden_norm.weight": 1 + 0.1 * torch.randn(H), "norm.weight": 1 + 0.1 * torch.randn(H)}
    for i in range(L):
        p = f"layers.{i}."
        s[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(H)
        s[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(H)
        for n, shape in [("self_attn.q_proj", (nh * hd, H)), ("self_attn.k_proj", (nkv * hd, H)),
                         ("self_attn.v_proj", (nkv * hd, H)), ("self_attn.o_proj", (H, nh * hd)),
                         ("mlp.gate_proj", (ff, H)), ("mlp.up_proj", (ff, H)), ("mlp.down_proj", (H, ff))]:
            s[p + n + ".weight"] = torch.randn(*shape) / math.sqrt(shape[1])
        if qk_norm:
            s[p + "self_attn.q_norm.weight"] = 1 + 0.1 * torch.randn(hd)
            s[p + "self_attn.k_norm.weight"] = 1 + 0.1 * torch.randn(hd)
    d = tmp_path / ("zlab-qk" if qk_norm else "zlab")
    d.mkdir()
    save_file(s, str(d / "model.safetensors"))
    cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=H, num_hidden_layers=L,
               num_attention_heads=nh, num_key_value_heads=nkv, head_dim=hd, intermediate_size=ff,
               vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", attention_bias=False,
               block_size=4, num_target_layers=4, dflash_config=dict(mask_token_id=mask_id, target_layer_ids=list(ids)))
    (d / "config.json").write_text(json.dumps(cfg))
    return d, s, cfg


def _dflash_direct(s, cfg, feats, ctx_len, block_tokens, embed, head):
    """DFlash's draft forward written out from its definition (z-lab DFlashDraftModel):
    target_hidden = hidden_norm(fc(feats)); per layer, the block queries attend (non-causally) to
    [k_proj(target_hidden); k_proj(block)] (q and k per-head RMS-normed first where the checkpoint
    has q_norm/k_norm) with NEOX rope at positions [0..ctx_len) and
    [ctx_len .. ctx_len + B); logits = head(norm(h)) of the MASK rows."""
    H, nh, nkv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x, pos):  # x [n, heads, hd], rotate_half convention
        inv = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = pos.double()[:, None] * inv
        cos, sin = torch.cat([ang.cos()] * 2, -1).float()[:, None], torch.cat([ang.sin()] * 2, -1).float()[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin

    ctx = rms(feats @ s["fc.weight"].T, s["hidden_norm.weight"])
    B = len(block_tokens)
    x = embed[torch.tensor(block_tokens)].clone()
    x[1:] = embed[cfg["dflash_config"]["mask_token_id"]]
    pos_c, pos_b = torch.arange(ctx_len), torch.arange(ctx_len, ctx_len + B)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, s[p + "input_layernorm.weight"])
        qn, kn = s.get(p + "self_attn.q_norm.weight"), s.get(p + "self_attn.k_norm.weight")
        qk = (lambda x, w: x) if qn is None else rms
        q = rope(qk((h @ s[p + "self_attn.q_proj.weight"].T).view(B, nh, hd), qn), pos_b)
        k = torch.cat([rope(qk((ctx @ s[p + "self_attn.k_proj.weight"].T).view(ctx_len, nkv, hd), kn), pos_c),
                       rope(qk((h @ s[p + "self_attn.k_proj.weight"].T).view(B, nkv, hd), kn), pos_b)])
        v = torch.cat([(ctx @ s[p + "self_attn.v_proj.weight"].T).view(ctx_len, nkv, hd),
                       (h @ s[p + "self_attn.v_proj.weight"].T).view(B, nkv, hd)])
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(B, nh * hd)
        x = x + o @ s[p + "self_attn.o_proj.weight"].T
        h = rms(x, s[p + "post_attention_layernorm.weight"])
        g, u = h @ s[p + "mlp.gate_proj.weight"].T, h @ s[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ s[p + "mlp.down_proj.weight"].T
    return rms(x, s["norm.weight"])[1:] @ head.T


@pytest.mark.parametrize("qk_norm", [False, True])
def test_zlab_dflash_mapping_matches_direct(llama_q, tmp_path, qk_norm):
    from blockspec.converters.dflash_hf import is_dflash_hf, load_dflash_hf
    from blockspec.models.target import load_target

    d, s, cfg = _zlab_dir(tmp_path, qk_norm=qk_norm)
    assert is_dflash_hf(d)
    model = load_dflash_hf(d, llama_q)
    a = model.args
    assert a.target_layers == [1, 3] and a.n_categories == 1 and a.block_size == 4 and a.draft_vocab_size == 0
    assert a.qk_norm is qk_norm
    tgt = load_target(llama_q, emulate_ggml=False)
    embed, head = tgt.tok_embeddings.weight, tgt.head_weight
    model.bind_target(embed, head)
    torch.manual_seed(2)
    S = 6  # context positions 0..5 have features; the block starts at position 6
    feats = torch.randn(1, S, 2 * 64)
    last = 42
    with torch.no_grad():
        out = model(feats, torch.tensor([[S - 1]]), torch.tensor([[last]]))
        ref = _dflash_direct(s, cfg, feats[0], S, [last, 0, 0, 0], embed, head)
    got = out.logits[0, 0, 0]  # [P, V]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_zlab_dflash_refusals(llama_q, tmp_path):
    from blockspec.converters.dflash_hf import load_dflash_hf

    # id 3 reads HF hidden_states[4] (after the final norm) of a 4-layer target: no tap has it
    d, _, _ = _zlab_dir(tmp_path, qk_norm=False, ids=(0, 3))
    with pytest.raises(BlockspecError, match="past the last tappable"):
        load_dflash_hf(d, llama_q)


def test_cli_drafter_zlab_to_upstream(llama_q, tmp_path):
    d, _, _ = _zlab_dir(tmp_path, qk_norm=False)
    out = tmp_path / "zlab-dflash.gguf"
    r = run_cli("convert", "drafter", str(d), str(out), "--target", str(llama_q), "--layout", "upstream-dflash",
                "--outtype", "f16")
    assert r.returncode == 0, r.stderr
    f = gguf.GGUFReader(str(out)).fields
    assert f["dflash.target_layers"].contents() == [1, 3]
    r = run_cli("convert", "drafter", str(d), str(tmp_path / "zlab-ours.gguf"), "--target", str(llama_q))
    assert r.returncode == 0, r.output
    f = gguf.GGUFReader(str(tmp_path / "zlab-ours.gguf")).fields
    assert f["general.architecture"].contents() == "dblast" and f["dblast.target_layers"].contents() == [1, 3]
    r = run_cli("convert", "drafter", str(d), str(tmp_path / "y.gguf"))
    assert r.returncode == 1 and "--target" in r.stderr and r.stderr.strip().count("\n") == 0


def test_cli_drafter_our_checkpoint_both_layouts(llama_q, tmp_path):
    """Our own checkpoint dir (drafter.safetensors + drafter.json, as models/train.py writes it)
    through both layouts: C1's blockspec GGUF and upstream's dflash."""
    from safetensors.torch import save_file

    model = _dblast()
    ck = tmp_path / "ckpt"
    ck.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ck / "drafter.safetensors"))
    import dataclasses

    (ck / "drafter.json").write_text(json.dumps(dict(model_args=dataclasses.asdict(model.args), config={}, step=0)))
    r = run_cli("convert", "drafter", str(ck), str(tmp_path / "ours.gguf"), "--target", str(llama_q))
    assert r.returncode == 0, r.output
    assert gguf.GGUFReader(str(tmp_path / "ours.gguf")).fields["general.architecture"].contents() == "dblast"
    r = run_cli("convert", "drafter", str(ck), str(tmp_path / "up.gguf"), "--target", str(llama_q),
                "--layout", "upstream-dflash", "--outtype", "q8_0")
    assert r.returncode == 0, r.output
    t = {x.name: x for x in gguf.GGUFReader(str(tmp_path / "up.gguf")).tensors}
    assert t["blk.0.attn_q.weight"].tensor_type.name == "Q8_0" and t["blk.0.attn_norm.weight"].tensor_type.name == "F32"


@pytest.mark.parametrize("qk_norm", [True, False])
def test_upstream_dflash_graph_runs_export(llama_q, tmp_path, qk_norm):
    """Upstream's own dflash graph (llama.cpp, in process: feature rows injected with llama_process,
    then the block [last, MASK x 3]) on the export of a DBlast with q/k norm (--qk-norm: upstream's
    graph as it is) or without (patch 0008 skips the norm) equals our DBlast, and the mask id never wins."""
    import ctypes

    import llama_cpp as ll

    from blockspec.converters.upstream_dflash import export_upstream_dflash
    from blockspec.models.target import load_target

    model = _dblast(qk_norm=qk_norm).eval()
    out = export_upstream_dflash(model, tmp_path / "dflash.gguf", target=llama_q, outtype="f32")
    tgt = load_target(llama_q, emulate_ggml=False)
    model.bind_target(tgt.tok_embeddings.weight, tgt.head_weight)
    torch.manual_seed(3)
    S, last = 7, 42
    feats = torch.randn(1, S, 128)
    with torch.no_grad():
        twin = model(feats, torch.tensor([[S - 1]]), torch.tensor([[last]])).logits[0, 0, 0].numpy()

    mdl = ll.llama_model_load_from_file(str(out).encode(), ll.llama_model_default_params())
    assert mdl
    cp = ll.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
    cp.n_threads = cp.n_threads_batch = 1
    ctx = ll.llama_init_from_model(mdl, cp)
    b = ll.llama_batch_ext_init(ctx)
    try:
        ll.llama_set_causal_attn(ctx, False)
        rows = np.ascontiguousarray(feats[0].numpy(), dtype=np.float32)
        for i in range(S):  # common/speculative.cpp's injection: one embedding row per context position
            e = ll.llama_embd()
            e.data, e.n_rows, e.n_embd = rows[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, rows.shape[1]
            idx = ll.llama_batch_ext_add_embd(b, 0, e)
            ll.llama_batch_ext_set_pos(b, idx, (ll.llama_pos * 4)(i, i, i, 0))
        assert ll.llama_process(ctx, ll.LLAMA_PROCESS_TYPE_DECODE, b) == 0
        ll.llama_batch_ext_clear(b)
        for j, tok in enumerate([last, VOCAB, VOCAB, VOCAB]):  # VOCAB = the appended mask token id
            idx = ll.llama_batch_ext_add_token(b, 0, tok)
            ll.llama_batch_ext_set_pos(b, idx, (ll.llama_pos * 4)(S + j, 0, 0, 0))
            ll.llama_batch_ext_set_output_logits(b, idx, True)
        assert ll.llama_process(ctx, ll.LLAMA_PROCESS_TYPE_DECODE, b) == 0
        got = np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, j), shape=(VOCAB + 1,)).copy()
                        for j in range(1, 4)])
    finally:
        ll.llama_batch_ext_free(b)
        ll.llama_free(ctx)
        ll.llama_model_free(mdl)
    assert np.isneginf(got[:, VOCAB]).all()
    # f32 weights; llama.cpp keeps K/V in f16 (measured max 0.03 on a scaled random drafter)
    np.testing.assert_allclose(got[:, :VOCAB], twin, atol=0.05)
    assert (got[:, :VOCAB].argmax(-1) == twin.argmax(-1)).all()


def test_bench_exports_blockspec_dblast_for_upstream(llama_q, tmp_path, monkeypatch):
    """The bench's llama.cpp-dflash peer takes a blockspec DBlast GGUF: exported to upstream's
    layout once (cached by content), an upstream GGUF passed through untouched."""
    from blockspec.converters.drafter import convert_drafter
    from blockspec.converters.upstream_dflash import cached_export

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    ours = convert_drafter(_dblast(qk_norm=True), tmp_path / "kz1.gguf", "q8_0", target=llama_q)
    up = cached_export(str(ours), llama_q)
    assert up.parent == tmp_path / "cache" / "exports"
    assert gguf.GGUFReader(str(up)).fields["general.architecture"].contents() == "dflash"
    stamp = up.stat().st_mtime_ns
    assert cached_export(str(ours), llama_q) == up and up.stat().st_mtime_ns == stamp
    assert cached_export(str(up), llama_q) == up


def test_train_average_two_drafters(tmp_path):
    """`blockspec train average --a A --b B --out C --weight w`: C's weights are (1 - w) A + w B, C loads as a
    drafter; drafters of different shapes: one line naming both, no C written."""
    import dataclasses

    from safetensors.torch import load_file, save_file

    from blockspec.models.checkpoint import load_checkpoint

    def ckpt(name, model):
        d = tmp_path / name
        d.mkdir()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "drafter.safetensors"))
        (d / "drafter.json").write_text(json.dumps(dict(model_args=dataclasses.asdict(model.args))))
        return d

    a, b = _dblast(seed=0), _dblast(seed=1)
    r = run_cli("train", "average", "--a", str(ckpt("a", a)), "--b", str(ckpt("b", b)), "--out", str(tmp_path / "c"), "--weight", "0.25")
    assert r.returncode == 0, r.output
    c = load_file(str(tmp_path / "c" / "drafter.safetensors"))
    for k, v in a.state_dict().items():
        torch.testing.assert_close(c[k], 0.75 * v + 0.25 * b.state_dict()[k])
    load_checkpoint(tmp_path / "c")
    r = run_cli("train", "average", "--a", str(tmp_path / "a"), "--b", str(ckpt("d", _dblast(n_layer=1))), "--out", str(tmp_path / "e"))
    assert r.returncode != 0 and "different shapes" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "e").exists()
    # B grown from A (`train --init A --n-layer 3`): A is grown the same way first, so the new layers'
    # zeroed outputs become w * B's
    g = load_checkpoint(tmp_path / "a")[0]
    g.grow_layers(a.args.n_layer + 1)
    r = run_cli("train", "average", "--a", str(tmp_path / "a"), "--b", str(ckpt("g", g)), "--out", str(tmp_path / "f"), "--weight", "0.5")
    assert r.returncode == 0, r.output
    f = load_file(str(tmp_path / "f" / "drafter.safetensors"))
    for k, v in g.state_dict().items():
        torch.testing.assert_close(f[k], v)
    # B reads one more tap (`train --init A --target-layers 1,2,3`): A's zero columns take B's scale, so the
    # average's columns for it are w * B's under B's scale, the old taps' the plain average
    t = load_checkpoint(tmp_path / "a")[0]
    t.grow_target_layers([1, 2, 3])
    with torch.no_grad():
        t.set_layer_scale(2, torch.full((64,), 0.5))
        t.fc.weight.normal_()
    r = run_cli("train", "average", "--a", str(tmp_path / "a"), "--b", str(ckpt("t", t)), "--out", str(tmp_path / "h"),
                "--weight", "0.25")
    assert r.returncode == 0, r.output
    h = load_file(str(tmp_path / "h" / "drafter.safetensors"))
    wa, wt = a.fc.weight, t.fc.weight
    torch.testing.assert_close(h["fc.weight"][:, 64:128], 0.25 * wt[:, 64:128])
    torch.testing.assert_close(h["fc.weight"][:, :64], 0.75 * wa[:, :64] + 0.25 * wt[:, :64])
    torch.testing.assert_close(h["fc.weight"][:, 128:], 0.75 * wa[:, 64:] + 0.25 * wt[:, 128:])
    torch.testing.assert_close(h["feat_scale"][64:128], torch.full((64,), 0.5))
    # B widened from A (`train --init A --ffn-dim`): A's new units take B's gate/up rows (their outputs are
    # zero in A), so the average's are B's, its down columns w * B's
    u = load_checkpoint(tmp_path / "a")[0]
    u.grow_ffn(a.args.ffn_dim + 32)
    with torch.no_grad():
        for p in u.parameters():
            p.add_(torch.randn_like(p))
    r = run_cli("train", "average", "--a", str(tmp_path / "a"), "--b", str(ckpt("u", u)), "--out", str(tmp_path / "k"),
                "--weight", "0.25")
    assert r.returncode == 0, r.output
    k, n = load_file(str(tmp_path / "k" / "drafter.safetensors")), a.args.ffn_dim
    ub, ua = u.layers[0].ffn, a.layers[0].ffn
    torch.testing.assert_close(k["layers.0.ffn.gate_proj.weight"][n:], ub.gate_proj.weight[n:])
    torch.testing.assert_close(k["layers.0.ffn.down_proj.weight"][:, n:], 0.25 * ub.down_proj.weight[:, n:])
    torch.testing.assert_close(k["layers.0.ffn.up_proj.weight"][:n], 0.75 * ua.up_proj.weight + 0.25 * ub.up_proj.weight[:n])
