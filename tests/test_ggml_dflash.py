"""DBlast with one category in llama.cpp through upstream's own `dflash` graph (runtime/drafters_ggml.py
GgmlDFlashDrafter) against the torch reference (models/dblast.py), on the bundled SmolLM2 as the target.

A tiny random DBlast (Kz = 1, q/k norm, reduced draft vocabulary) at SmolLM2's width is written as a
blockspec GGUF (f32); the ggml backend runs its upstream export. Both read the same real target taps
and rows (prefill chunks, a rolled-back step, single rows); the block logits are compared at every
anchor. Then the ggml drafter drives the engine: greedy output equals plain output. Drafters the
upstream graph does not compute exactly (categories, no q/k norm) are refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest

from blockspec.runtime.drafters import make_drafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.generate import generate
from blockspec.runtime.prompt import prompt_tokens
from blockspec.runtime.sampling import SamplingParams

from prompts import PROMPTS
from test_ggml_drafter import FEEDS, target, taps  # noqa: F401 - module fixtures: SmolLM2 and its real taps

torch = pytest.importorskip("torch")

LAYERS = [1, 15, 29]  # the taps fixture's layers
SMOL = dict(model_type="dblast", dim=576, target_dim=576, n_head=9, n_kv_head=3, head_dim=64, ffn_dim=256,
            vocab_size=49152, n_layer=2, block_size=5, target_layers=LAYERS, n_categories=1, qk_norm=True,
            draft_vocab_size=1024)


def random_dblast(seed: int, **over):
    from blockspec.models import build_model

    torch.manual_seed(seed)
    m = build_model({**SMOL, **over}).eval()
    with torch.no_grad():
        if m.vocab.lm_head is not None:
            m.vocab.lm_head.weight.mul_(8.0)  # spread the logits: near-ties would make top-1 a coin flip
            m.vocab.set_vocab(torch.randperm(SMOL["vocab_size"])[:m.args.draft_vocab_size].sort().values)
        m.mask_embedding.normal_(0.0, 1.0)
        for layer in m.layers if m.args.qk_norm else []:
            layer.attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.attn.k_norm.weight.uniform_(0.5, 1.5)
        m.feat_scale.copy_(2.0 ** torch.randint(-6, 0, m.feat_scale.shape))  # folded into fc by the export
    return m


@pytest.fixture(scope="module")
def drafter_file(tmp_path_factory, smollm2_path):
    from blockspec.converters.drafter import convert_drafter

    m = random_dblast(0)
    path = convert_drafter(m, tmp_path_factory.mktemp("dflash") / "kz1.gguf", "f32", target=smollm2_path)
    return str(path), m


@pytest.fixture(autouse=True)
def export_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "dflash-cache"))


def _torch_drafter(model, target):
    import os

    from blockspec.runtime.drafters_torch import DBlastDrafter, _target_weights

    embed, _ = _target_weights(str(target.path), os.path.getmtime(target.path), False)
    model.bind_target(embed, embed)  # SmolLM2 ties its head to its embeddings
    return DBlastDrafter(model, {}, "")


def test_block_logits_match_torch(target, taps, drafter_file):  # noqa: F811
    from blockspec.runtime.drafters_ggml import GgmlDFlashDrafter

    path, model = drafter_file
    gd = GgmlDFlashDrafter(path, kv_type="f32", n_ctx=128)
    gd.check_target(target)
    td = _torch_drafter(model, target)
    d2t = model.vocab.d2t.numpy()
    toks, feats = taps
    rows = lambda a, b: {lid: f[a:b] for lid, f in feats.items()}  # noqa: E731
    gl, tl = [], []
    for feed in FEEDS:
        a, b = feed[:2]
        if len(feed) == 3:  # rows of a rejected step, rolled back
            for d in (gd, td):
                d.observe([7] * (b - a), a, rows(b + 5, b + 5 + (b - a)))
                d.trim(a)
            continue
        for d in (gd, td):
            d.observe(toks[a:b], a, rows(a, b))
        hist = toks[:b + 1]
        g = gd.block_logits(hist)
        with torch.inference_mode():
            anchors, last = td._anchor(hist)
            t = td.model(td._empty, anchors, last, td.cache).logits[0, 0, 0].float().numpy()
        assert g.shape == (4, 49153)
        assert np.isneginf(g[:, 49152]).all()  # the appended mask id never wins
        gl.append(g[:, d2t])
        tl.append(t)
        assert gd.propose(hist).tokens == td.propose(hist).tokens
    gl, tl = np.concatenate(gl), np.concatenate(tl)
    top1 = float((gl.argmax(-1) == tl.argmax(-1)).mean())
    dmax = float(np.abs(gl - tl).max())
    print(f"\nupstream dflash graph vs torch DBlast: top-1 agreement {top1:.3f} over {len(gl)} rows, "
          f"max |dlogit| {dmax:.2e} (logit range {tl.min():.1f}..{tl.max():.1f})")
    # f32 weights; measured max 0.23 on logits spread over +-15 (the head is scaled x8 to spread
    # them), about what f16 rounding inside upstream's graph gives
    assert top1 >= 0.99 and dmax <= 0.3
    gd.close()


def test_greedy_speculative_equals_plain(target, drafter_file):  # noqa: F811
    path, _ = drafter_file
    prompt = prompt_tokens(target, PROMPTS[5])
    greedy = SamplingParams(temperature=0.0)
    want = generate(target, prompt, max_tokens=24, sampling=greedy).tokens
    d = make_drafter("dblast", path, None, block_size=4)  # a Kz = 1, q/k-norm GGUF -> ggml
    assert d.backend == "ggml" and d.name == "dblast"
    spec = generate(target, prompt, max_tokens=24, sampling=greedy, drafter=d)
    assert spec.tokens == want
    d.close()


@pytest.mark.parametrize("over,why", [(dict(n_categories=4), "4 categories"), (dict(qk_norm=False), "no q/k norm")])
def test_refuses_what_upstream_cannot_compute(tmp_path, smollm2_path, over, why):
    from blockspec.converters.drafter import convert_drafter
    from blockspec.runtime.drafters_ggml import GgmlDFlashDrafter

    path = convert_drafter(random_dblast(1, **over), tmp_path / "d.gguf", "f16", target=smollm2_path)
    with pytest.raises(BlockspecError, match=why) as e:
        GgmlDFlashDrafter(path)
    assert "\n" not in str(e.value) and "--drafter-backend torch" in str(e.value)
    assert make_drafter("dblast", str(path), None).backend == "torch"  # the default falls back to torch
