"""DBlast in llama.cpp through upstream's `dflash` graph with patch 0008 (runtime/drafters/ggml_backend.py
GgmlDFlashDrafter) against the torch reference (models/dblast.py), on the bundled SmolLM2 as the target.

Tiny random DBlasts at SmolLM2's width are written as blockspec GGUFs (f32); the ggml backend runs
their upstream exports: plain DFlash (Kz = 1, q/k norm, reduced draft vocabulary: upstream's graph as
it is) and DBlast with 4 categories and no q/k norm (the patch's category prior/expander and optional
q/k norm). Both backends read the same real target taps and rows (prefill chunks, a rolled-back
step, single rows); block logits (every category's, and the prior) are compared at every anchor.
Then the ggml drafter drives the engine: greedy output equals plain output, one branch or several.
"""

from __future__ import annotations

import numpy as np
import pytest

from blockspec.runtime.engine.setup import make_drafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams

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


# name: (model overrides, GGUF type)
VARIANTS = {"kz1-qknorm-f32": (dict(), "f32"), "kz4-f32": (dict(n_categories=4, qk_norm=False), "f32"),
            "kz4-f16": (dict(n_categories=4, qk_norm=False), "f16")}


@pytest.fixture(scope="module", params=list(VARIANTS))
def drafter_file(request, tmp_path_factory, smollm2_path):
    from blockspec.converters.drafter import convert_drafter

    over, outtype = VARIANTS[request.param]
    m = random_dblast(0, **over)
    if m.category_expander is not None:
        with torch.no_grad():  # offsets as large as the states, so a wrong category shows
            m.category_expander.weight.normal_(0.0, 1.0 / m.args.dim ** 0.5)
    path = convert_drafter(m, tmp_path_factory.mktemp("dflash") / f"{request.param}.gguf", outtype,
                           target=smollm2_path)
    if outtype == "f16":  # the torch reference computes with the weights the GGUF holds
        from blockspec.models.checkpoint import load_checkpoint

        m = load_checkpoint(path)[0].float().eval()
    return str(path), m


@pytest.fixture(autouse=True)
def export_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path_factory.getbasetemp() / "dflash-cache"))


def _torch_drafter(model, target, branches=1):
    import os

    from blockspec.runtime.drafters.torch_backend import DBlastDrafter, _target_weights

    embed, _ = _target_weights(str(target.path), os.path.getmtime(target.path), False)
    model.bind_target(embed, embed)  # SmolLM2 ties its head to its embeddings
    return DBlastDrafter(model, {}, "", branches=branches, z_temperature=0.0)


def test_block_logits_match_torch(target, taps, drafter_file):  # noqa: F811
    from blockspec.runtime.drafters.ggml_backend import GgmlDFlashDrafter

    path, model = drafter_file
    Kz = model.args.n_categories
    gd = GgmlDFlashDrafter(path, kv_type="f32", n_ctx=128, branches=2)
    gd.check_target(target)
    td = _torch_drafter(model, target, branches=2)
    d2t = model.vocab.d2t.numpy()
    toks, feats = taps
    rows = lambda a, b: {lid: f[a:b] for lid, f in feats.items()}  # noqa: E731
    gl, tl, gp, tp, props = [], [], [], [], []
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
        with torch.inference_mode():
            anchors, last = td._block_inputs(hist)
            out = td.model(td._empty, anchors, last, td.cache)
        t = out.logits[0, 0].float().numpy()  # [Kz, 4, Vd]
        if Kz == 1:
            g = gd.block_logits(hist)
            assert g.shape == (4, 49153)
            assert np.isneginf(g[:, 49152]).all()  # the appended mask id never wins
            g = g[None, :, d2t]
        else:  # every category's branch in one pass, then the prior
            prior, g = gd.branch_logits(hist, z=list(range(Kz)))
            assert g.shape == (Kz, 4, len(d2t)) and prior.shape == (Kz,)
            gp.append(prior)
            tp.append(out.prior_logits[0, 0].float().numpy())
        gl.append(g.reshape(-1, g.shape[-1]))
        tl.append(t.reshape(-1, t.shape[-1]))
        props.append((gd.propose(hist).tokens, td.propose(hist).tokens))  # top-2 categories (Kz > 1), greedy
    gl, tl = np.concatenate(gl), np.concatenate(tl)
    top1 = float((gl.argmax(-1) == tl.argmax(-1)).mean())
    dmax = float(np.abs(gl - tl).max())
    f16 = "f16" in path
    print(f"\nupstream dflash graph (Kz = {Kz}, {'f16' if f16 else 'f32'}) vs torch DBlast: top-1 agreement "
          f"{top1:.3f} over {len(gl)} rows, max |dlogit| {dmax:.2e} (logit range {tl.min():.1f}..{tl.max():.1f})")
    # measured with f32 KV: f32 weights max 1e-5 on logits spread over +-19 (the head is scaled x8
    # to spread them); f16 weights (torch computing in f32 from the same f16 values) a little more
    assert top1 >= 0.99 and dmax <= (0.05 if f16 else 1e-3)
    # where the argmax differs, torch saw a near-tie: its top two lie within the rounding error
    for g, t in zip(gl, tl):
        if g.argmax() != t.argmax():
            assert t.max() - t[g.argmax()] <= 2 * dmax
    if not f16:  # f16 matmuls round the activations too: a near-tie may flip a drafted token (checked above)
        assert all(a == b for a, b in props)
    if Kz > 1:  # branch categories are ids or -1..-n; anything else is one line, nothing run
        with pytest.raises(BlockspecError, match="neither ids nor") as e:
            gd.branch_logits(hist, z=[0, -1])
        assert "\n" not in str(e.value)
    if gp:
        gp, tp = np.stack(gp), np.stack(tp)
        print(f"category prior: max |d| {np.abs(gp - tp).max():.2e}, argmax agreement "
              f"{(gp.argmax(-1) == tp.argmax(-1)).mean():.3f} over {len(gp)} blocks")
        assert np.abs(gp - tp).max() <= 0.05 and (np.argsort(-gp, -1)[:, :2] == np.argsort(-tp, -1)[:, :2]).all()
    gd.close()


def test_greedy_speculative_equals_plain(target, drafter_file):  # noqa: F811
    path, model = drafter_file
    prompt = prompt_tokens(target, PROMPTS[5])
    greedy = SamplingParams(temperature=0.0)
    want = generate(target, prompt, max_tokens=24, sampling=greedy).tokens
    for branches in (1, 2) if model.args.n_categories > 1 else (1,):
        d = make_drafter("dblast", path, None, block_size=4, branches=branches)  # every DBlast GGUF -> ggml
        assert d.backend == "ggml" and d.name == "dblast" and d.max_leaves == branches
        spec = generate(target, prompt, max_tokens=24, sampling=greedy, drafter=d)
        assert spec.tokens == want, f"{branches} branches"
        d.close()
