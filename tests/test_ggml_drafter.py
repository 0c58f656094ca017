"""SpecBlock drafter inside llama.cpp (ggml_patches/0006, runtime/drafters/ggml_backend.py) against the torch
reference (models/specblock.py), on the bundled SmolLM2 as the target.

A tiny random SpecBlock at SmolLM2's width is written as a drafter GGUF (f32, f16, q8_0); the torch
reference gets the very weights the GGUF stores (f16 / q8_0 rounded the same way). Both read the
same real target taps, feed the same rows (prefill chunks, a rolled-back step, single rows), and
the block logits, rank logits and proposals are compared at every anchor. Then the ggml drafter
drives the speculative engine: greedy output equals plain output.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from blockspec.runtime.engine.setup import make_drafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.llama.target import Target, TargetConfig
from blockspec.runtime.drafters.tree import DraftTree

from prompts import PROMPTS

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

LAYERS = [1, 15, 29]
SMOL = dict(model_type="specblock", dim=576, target_dim=576, n_head=9, n_kv_head=3, head_dim=64,
            ffn_dim=256, vocab_size=49152, n_layer=2, block_size=4, target_layers=LAYERS,
            rank_widths=[1, 2, 4, 8], rank_top_k=4, rank_hidden=64)
# max |logit difference| allowed per GGUF type (logits of this drafter spread over ~+-10); measured
# maxima are printed by the test. f16/q8_0 matmuls round the activations too (to f16 / q8_0).
TOL = {"f32": 2e-3, "f16": 0.05, "q8_0": 0.3}
TOP1 = {"f32": 0.99, "f16": 0.99, "q8_0": 0.9}  # q8_0 rounds activations: near-ties may flip (checked)
RANK_TOL = {"f32": 2e-3, "f16": 0.02, "q8_0": 0.1}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def random_specblock(seed: int, **over):
    from blockspec.models import build_model

    torch.manual_seed(seed)
    m = build_model({**SMOL, **over}).eval()
    with torch.no_grad():
        if m.vocab.lm_head is not None:
            m.vocab.lm_head.weight.mul_(8.0)  # spread the logits: near-ties would make top-1 a coin flip
            d2t = torch.randperm(SMOL["vocab_size"])[:m.args.draft_vocab_size].sort().values
            m.vocab.set_vocab(d2t)
        m.pos_query.normal_(0.0, 1.0)
        for lin in m.shift:  # a real mix of position k-1, not the near-identity start
            lin.weight.normal_(0.0, 1.0 / (2 * m.args.dim) ** 0.5)
    return m


def _stored(model, outtype: str):
    """The torch drafter holding exactly what a GGUF of `outtype` stores (FORMAT.md rules)."""
    from blockspec.runtime.format.drafter_gguf import keep_f32, torch_to_gguf_name

    ref = copy.deepcopy(model)
    if outtype == "f32":
        return ref
    with torch.no_grad():
        for name, p in ref.state_dict().items():
            if p is None or name in ("vocab.d2t", "feat_scale") or \
                    keep_f32(torch_to_gguf_name(name, "specblock"), p.ndim):
                continue
            x = p.float().numpy()
            if outtype == "q8_0" and x.shape[-1] % 32 == 0:
                q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
                x = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
            else:
                x = x.astype(np.float16).astype(np.float32)
            p.copy_(torch.from_numpy(np.ascontiguousarray(x)))
    return ref


def write_gguf(model, path, outtype: str, target_path, skip_keys=()) -> str:
    """Drafter GGUF through the project's converter when it is there, else the FORMAT.md layout
    written directly (the same keys and tensor names, from runtime/format/drafter_gguf.py); `skip_keys`
    (ModelArgs fields) writes a broken file without those keys."""
    try:
        from blockspec.converters.drafter import convert_drafter
    except ImportError:
        convert_drafter = None
    if convert_drafter is not None and not skip_keys:
        return str(convert_drafter(model, path, outtype=outtype, target=str(target_path)))
    from blockspec.runtime.format.drafter_gguf import ARGS_KEYS, ARCH_ARGS_KEYS, Keys, keep_f32, torch_to_gguf_name

    a, arch = model.args, "specblock"
    w = gguf.GGUFWriter(str(path), arch)
    for field, (tmpl, kind) in {**ARGS_KEYS, **ARCH_ARGS_KEYS[arch]}.items():
        if field in skip_keys:
            continue
        key, v = Keys.of(tmpl, arch), getattr(a, field)
        if kind == "u32":
            w.add_uint32(key, int(v))
        elif kind == "f32":
            w.add_float32(key, float(v))
        else:
            w.add_key_value(key, [int(i) for i in v], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_uint32(Keys.of(Keys.VALUE_LENGTH, arch), int(a.head_dim))
    for name, t in model.export_state().items():
        if t is None:
            continue
        g = torch_to_gguf_name(name, arch)
        if g == "d2t":
            w.add_tensor(g, t.to(torch.int32).numpy())
            continue
        x = t.detach().float().numpy()
        if keep_f32(g, x.ndim) or outtype == "f32":
            w.add_tensor(g, x)
        elif outtype == "q8_0" and x.shape[-1] % 32 == 0:
            w.add_tensor(g, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(g, x.astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=512, n_seq_max=16)) as t:
        yield t


@pytest.fixture(scope="module")
def taps(target):
    """Real target taps of one prompt's tokens: (tokens, {layer: [n, 576]})."""
    toks = prompt_tokens(target, PROMPTS[0])[:40]
    target.clear()
    target.enable_taps(LAYERS)
    target.decode(toks, range(len(toks)), logits=[False] * len(toks))
    feats = {lid: target.tap(lid).copy() for lid in LAYERS}
    target.clear()
    return toks, feats


@pytest.fixture(scope="module")
def drafters(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("ggml_drafters")
    out = {}
    m = random_specblock(0, draft_vocab_size=1024)
    for ot in ("f32", "f16", "q8_0"):
        out[ot] = (write_gguf(m, root / f"sb-{ot}.gguf", ot, smollm2_path), _stored(m, ot))
    shared = random_specblock(1, draft_vocab_size=0)
    out["shared"] = (write_gguf(shared, root / "sb-shared.gguf", "f32", smollm2_path), shared)
    k16 = random_specblock(2, draft_vocab_size=1024, block_size=16, n_layer=3)  # deeper, too
    out["k16"] = (write_gguf(k16, root / "sb-k16.gguf", "f32", smollm2_path), k16)
    return out


def _bind_torch(model, target):
    import os

    from blockspec.runtime.drafters.torch_backend import SpecBlockDrafter, _target_weights

    # SmolLM2 ties its head to its token embeddings (no output.weight), so one read of the
    # target GGUF (seconds) serves both drafters
    embed, _ = _target_weights(str(target.path), os.path.getmtime(target.path), False)
    model.bind_target(embed, embed)
    return SpecBlockDrafter(model, {}, "", block_size=None)


# rows fed to both drafters: (start, end) of the committed tokens; (start, end, "x") feeds rows that
# are rolled back next (a rejected step), then the anchors are every position after each feed
FEEDS = [(0, 17), (17, 20), (20, 23, "x"), (20, 21), (21, 25), (25, 26), (26, 30), (30, 31)]


def _run_both(gd, td, toks, feats, feeds=FEEDS):
    """Block outputs of ggml drafter gd and torch drafter td after each feed: lists of
    (ggml logits, torch logits, ggml rank, torch rank, history)."""
    rows = lambda a, b: {lid: f[a:b] for lid, f in feats.items()}  # noqa: E731
    res = []
    for feed in feeds:
        a, b = feed[:2]
        if len(feed) == 3:
            junk = rows(b + 5, b + 5 + (b - a))
            gd.observe([7] * (b - a), a, junk)
            td.observe([7] * (b - a), a, junk)
            gd.trim(a)
            td.trim(a)
            continue
        gd.observe(toks[a:b], a, rows(a, b))
        td.observe(toks[a:b], a, rows(a, b))
        hist = toks[:b + 1]
        gl, gr = gd.block_outputs(hist)
        with torch.inference_mode():
            anchors, last = td._block_inputs(hist)
            out = td.model(td._empty, anchors, last, td.cache)
        res.append((gl, out.logits[0, 0].float().numpy(), gr, out.rank_logits[0, 0].float().numpy(), hist))
    return res


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_block_logits_match_torch(target, taps, drafters, outtype):
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter

    path, ref = drafters[outtype]
    gd = GgmlSpecBlockDrafter(path, kv_type="f32", n_ctx=128)
    gd.check_target(target)
    td = _bind_torch(ref, target)
    toks, feats = taps
    res = _run_both(gd, td, toks, feats)
    gl = np.concatenate([r[0] for r in res])
    tl = np.concatenate([r[1] for r in res])
    gr = np.concatenate([r[2] for r in res])
    tr = np.concatenate([r[3] for r in res])
    assert gl.shape == tl.shape == (len(res) * 4, 1024) and gr.shape == tr.shape == (len(res) * 4, 4)
    top1 = float((gl.argmax(-1) == tl.argmax(-1)).mean())
    dmax, rmax = float(np.abs(gl - tl).max()), float(np.abs(gr - tr).max())
    print(f"\n{outtype}: top-1 agreement {top1:.3f} over {len(gl)} rows, max |dlogit| {dmax:.2e} "
          f"(logit range {tl.min():.1f}..{tl.max():.1f}), max |drank| {rmax:.2e}")
    assert top1 >= TOP1[outtype]
    assert dmax <= TOL[outtype]
    # where the argmax differs, torch saw a near-tie: its top two lie within the rounding error
    for g, t in zip(gl, tl):
        if g.argmax() != t.argmax():
            assert t.max() - t[g.argmax()] <= 2 * dmax
    assert rmax <= RANK_TOL[outtype]
    # greedy proposals (chain) are the same target ids
    if outtype != "q8_0":
        for g, t, _, _, hist in res:
            want = td.model.vocab.to_target(torch.from_numpy(t).argmax(-1)).tolist()
            assert gd.to_target(g.argmax(-1)).tolist() == want
        hist = res[-1][4]  # the drafters are in step with the last history
        assert gd.propose(hist).tokens == td.propose(hist).tokens == [hist[-1], *want]
    gd.close()


@pytest.mark.parametrize("block_size", [16, 8])
def test_long_block_matches_torch(target, taps, drafters, block_size):
    """A K = 16 drafter (what GPU users run) with 3 layers (a grown one) in llama.cpp: the whole
    block, and its first 8 rows when drafting blocks of 8, are torch's (f32)."""
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter

    path, ref = drafters["k16"]
    gd = GgmlSpecBlockDrafter(path, block_size=block_size, kv_type="f32", n_ctx=128)
    gd.check_target(target)
    assert gd.n_predict == 16
    res = _run_both(gd, _bind_torch(ref, target), *taps)
    gl = np.concatenate([r[0] for r in res])
    tl = np.concatenate([r[1][:block_size] for r in res])
    assert gl.shape == tl.shape == (len(res) * block_size, 1024)
    assert float(np.abs(gl - tl).max()) <= TOL["f32"]
    assert float((gl.argmax(-1) == tl.argmax(-1)).mean()) >= TOP1["f32"]
    gd.close()


def test_shared_head_matches_torch(target, taps, drafters):
    """draft_vocab_size 0: the block logits come from the target's own (Q4_1) head via ctx_other."""
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter

    path, ref = drafters["shared"]
    gd = GgmlSpecBlockDrafter(path, kv_type="f32", n_ctx=128)
    gd.check_target(target)
    td = _bind_torch(ref, target)
    toks, feats = taps
    res = _run_both(gd, td, toks, feats, FEEDS[:5])
    gl = np.concatenate([r[0] for r in res])
    tl = np.concatenate([r[1] for r in res])
    assert gl.shape == tl.shape == (len(res) * 4, 49152)
    top1 = float((gl.argmax(-1) == tl.argmax(-1)).mean())
    dmax = float(np.abs(gl - tl).max())
    print(f"\nshared head: top-1 agreement {top1:.3f}, max |dlogit| {dmax:.2e}")
    # the Q4_1 head multiplies q8_1-rounded activations in ggml: ~0.1 apart at most
    assert top1 >= 0.99 and dmax <= 0.2
    gd.close()


def test_tree_proposals_match_torch(target, taps, drafters):
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter
    from blockspec.runtime.drafters.torch_backend import SpecBlockDrafter

    path, ref = drafters["f32"]
    gd = GgmlSpecBlockDrafter(path, tree=True, max_nodes=10, kv_type="f32", n_ctx=128)
    gd.check_target(target)
    td = _bind_torch(ref, target)
    td = SpecBlockDrafter(td.model, {}, "", tree=True, max_nodes=10)
    toks, feats = taps
    n = 24
    for d in (gd, td):
        d.observe(toks[:n], 0, {lid: f[:n] for lid, f in feats.items()})
    widths = set()
    for end in range(n, n + 6):
        if end > n:
            for d in (gd, td):
                d.observe(toks[end - 1:end], end - 1, {lid: f[end - 1:end] for lid, f in feats.items()})
        g, t = gd.propose(toks[:end + 1]), td.propose(toks[:end + 1])
        assert isinstance(g, DraftTree) and g.tokens == t.tokens and g.parents == t.parents
        widths.add(len(g.leaves()))
    assert max(widths) > 1  # the random rank head branched somewhere
    gd.close()


def test_greedy_speculative_equals_plain(target, drafters):
    """Lossless with the ggml drafter (random weights: mostly rejected drafts), chain and tree."""
    path, _ = drafters["f16"]
    prompt = prompt_tokens(target, PROMPTS[5])
    greedy = SamplingParams(temperature=0.0)
    want = generate(target, prompt, max_tokens=24, sampling=greedy).tokens
    for branches in (1, 2):
        d = make_drafter("specblock", path, None, block_size=4, branches=branches)  # .gguf -> ggml
        assert d.backend == "ggml" and d.name == "specblock"
        spec = generate(target, prompt, max_tokens=24, sampling=greedy, drafter=d)
        assert spec.tokens == want
        assert d.tokens == (prompt + spec.tokens)[:len(d.tokens)] and len(d.tokens) >= len(prompt)
        d.close()


def test_bad_pairing_and_files_fail_in_one_line(target, drafters, tmp_path, smollm2_path):
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter

    d = GgmlSpecBlockDrafter(drafters["f32"][0])
    d.header["meta"]["model_args"]["target_dim"] = 640  # as if written for a wider target
    with pytest.raises(BlockspecError, match="width"):
        d.check_target(target)
    d.close()
    with pytest.raises(BlockspecError, match="does not exist"):
        make_drafter("specblock", str(tmp_path / "none.gguf"), "ggml")
    with pytest.raises(BlockspecError, match="not a blockspec drafter"):
        make_drafter("specblock", str(smollm2_path), "ggml")
    with pytest.raises(BlockspecError, match="not dblast"):
        make_drafter("dblast", drafters["f32"][0], "ggml")


def test_missing_metadata_names_the_key(target, tmp_path, smollm2_path, monkeypatch):
    """A drafter GGUF without a key the graph needs: header check and llama.cpp both name it."""
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter, read_drafter_header

    m = random_specblock(3, draft_vocab_size=64)
    bad = write_gguf(m, tmp_path / "no-topk.gguf", "f32", smollm2_path, skip_keys=("rank_top_k",))
    with pytest.raises(BlockspecError, match="specblock.rank_top_k"):
        make_drafter("specblock", bad, "ggml")
    h = read_drafter_header(write_gguf(m, tmp_path / "ok.gguf", "f32", smollm2_path, skip_keys=("x",)))
    assert h["rank_top_k"] == 4 and h["block_size"] == 4 and len(h["d2t"]) == 64
    # llama.cpp's own loader (the runtime header check bypassed) refuses it naming the key
    import blockspec.runtime.drafters.ggml_backend as dg

    real = dg.read_drafter_header
    monkeypatch.setattr(dg, "read_drafter_header", lambda p: {**real(tmp_path / "ok.gguf"), "path": str(p)})
    with pytest.raises(BlockspecError, match="specblock.rank_top_k"):
        GgmlSpecBlockDrafter(bad)
