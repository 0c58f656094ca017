"""Drafter GGUF converter (converters/drafter.py, layout runtime/format/drafter_gguf.py).

Tiny random SpecBlock / DBlast drafters (Kz = 1 and 4, with and without a reduced draft vocabulary)
-> GGUF (f32, f16, q8_0) -> gguf.GGUFReader: every key (name and type) and tensor (name, shape,
dtype) the layout prescribes, nothing else; the torch module rebuilt from the file gives the same
logits (f32 bit-exact; f16 / q8_0 within a stated tolerance and top-1 agreement); drafters paired
with the wrong target and truncated/corrupt files are refused with one line; and a GGUF drafter
runs in the engine's torch backend with output equal to plain greedy decoding.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from blockspec.runtime.errors import BlockspecError

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from blockspec.converters.drafter import CONVERTERS, convert_drafter  # noqa: E402
from blockspec.models.checkpoint import read_drafter_gguf  # noqa: E402
from blockspec.runtime.format.drafter_gguf import OUTTYPES, check_pairing, read_drafter_meta, target_fingerprint  # noqa: E402
from blockspec.models import build_model  # noqa: E402
from blockspec.models.target import ModelArgs as TargetArgs  # noqa: E402
from fixtures_target import write_tiny_gguf  # noqa: E402

V, H, NL = 256, 64, 4  # tiny target: vocabulary, width, layers
TINY = dict(dim=H, target_dim=H, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=96, vocab_size=V, n_layer=2)
CASES = {
    "specblock": dict(model_type="specblock", block_size=4, target_layers=[1, 2, 3], draft_vocab_size=0),
    "specblock-dv": dict(model_type="specblock", block_size=3, target_layers=[1, 3], draft_vocab_size=32,
                         rank_widths=[1, 2, 3, 6], rank_hidden=24),
    "dblast-kz1": dict(model_type="dblast", block_size=5, target_layers=[0, 1, 2, 3], n_categories=1,
                       draft_vocab_size=0),
    "dblast-kz4-dv": dict(model_type="dblast", block_size=4, target_layers=[1, 2], n_categories=4,
                          draft_vocab_size=32),
    "dblast-kz1-qk": dict(model_type="dblast", block_size=5, target_layers=[1, 3], n_categories=1,
                          draft_vocab_size=0, qk_norm=True),
}
# stated tolerances for the rebuilt module's logits: max |diff| relative to max |logit|, and the
# share of positions whose argmax is unchanged (random weights make many near-ties)
TOL = {"f32": (0.0, 1.0), "f16": (5e-3, 0.95), "q8_0": (3e-2, 0.85)}


def tokenizer_source(path, tokens):
    """A metadata-only GGUF holding a tokenizer, for write_tiny_gguf(tokenizer_from=...)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_target(path, tokens, dim=H, n_layer=NL, vocab=V, tmp=None):
    args = TargetArgs(arch="llama", dim=dim, n_layer=n_layer, n_head=4, n_kv_head=2, head_dim=dim // 4,
                      ffn_dim=96, vocab_size=vocab)
    src = tokenizer_source(path.with_suffix(".tok.gguf"), tokens[:vocab])
    write_tiny_gguf(path, args, tokenizer_from=src)
    return path


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("targets")
    toks = [f"t{i}" for i in range(400)]
    other = list(toks)
    other[7] = "x7"
    return {
        "ok": tiny_target(root / "ok.gguf", toks),
        "tokenizer": tiny_target(root / "tok.gguf", other),
        "width": tiny_target(root / "width.gguf", toks, dim=32),
        "vocab": tiny_target(root / "vocab.gguf", toks, vocab=300),
        "layers": tiny_target(root / "layers.gguf", toks, n_layer=2),
    }


def make_drafter(case: str, seed: int = 0):
    torch.manual_seed(seed)
    m = build_model({**TINY, **CASES[case]})
    with torch.no_grad():  # move every parameter off its init (norm weights of 1, zero biases)
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
        # a feature scale, which the converter folds into fc; powers of two keep f32 bit-exact
        m.feat_scale.copy_(2.0 ** torch.randint(-3, 4, m.feat_scale.shape))
    if m.args.draft_vocab_size:
        m.vocab.set_vocab(torch.randperm(V)[:m.args.draft_vocab_size])
    return m.eval()


def expected_layout(args) -> dict:
    """FORMAT.md written out for these args: GGUF name -> (torch shape, 'mat' | 'f32' | 'i32')."""
    a = args
    t = {"fc.weight": ((H, len(a.target_layers) * H), "mat"), "enc.output_norm.weight": ((H,), "f32"),
         "output_norm.weight": ((H,), "f32")}
    q, kv = a.n_head * a.head_dim, a.n_kv_head * a.head_dim
    for i in range(a.n_layer):
        t.update({f"blk.{i}.attn_norm.weight": ((H,), "f32"), f"blk.{i}.attn_q.weight": ((q, H), "mat"),
                  f"blk.{i}.attn_k.weight": ((kv, H), "mat"), f"blk.{i}.attn_v.weight": ((kv, H), "mat"),
                  f"blk.{i}.attn_output.weight": ((H, q), "mat"), f"blk.{i}.ffn_norm.weight": ((H,), "f32"),
                  f"blk.{i}.ffn_gate.weight": ((a.ffn_dim, H), "mat"), f"blk.{i}.ffn_up.weight": ((a.ffn_dim, H), "mat"),
                  f"blk.{i}.ffn_down.weight": ((H, a.ffn_dim), "mat")})
    if a.draft_vocab_size:
        t["output.weight"] = ((a.draft_vocab_size, H), "mat")
        t["d2t"] = ((a.draft_vocab_size,), "i32")
    if a.model_type == "specblock":
        t["blockspec.in_proj.weight"] = ((H, 2 * H), "mat")
        t["blockspec.pos_query"] = ((a.block_size, H), "f32")
        for i in range(a.n_layer - 1):
            t[f"blk.{i + 1}.shift.weight"] = ((H, 2 * H), "mat")
        n_in = H + 2 * a.rank_top_k
        t.update({"blockspec.rank_fc1.weight": ((a.rank_hidden, n_in), "f32"),
                  "blockspec.rank_fc1.bias": ((a.rank_hidden,), "f32"),
                  "blockspec.rank_fc2.weight": ((len(a.rank_widths), a.rank_hidden), "f32"),
                  "blockspec.rank_fc2.bias": ((len(a.rank_widths),), "f32")})
    else:
        t["blockspec.mask_embd"] = ((H,), "f32")
        if a.qk_norm:
            for i in range(a.n_layer):
                t[f"blk.{i}.attn_q_norm.weight"] = ((a.head_dim,), "f32")
                t[f"blk.{i}.attn_k_norm.weight"] = ((a.head_dim,), "f32")
        if a.n_categories > 1:
            kz = a.n_categories
            t.update({"blockspec.cat_prior.weight": ((kz, H), "mat"), "blockspec.cat_prior.bias": ((kz,), "f32"),
                      "blockspec.cat_expander.weight": ((kz * H, H), "mat"),
                      "blockspec.cat_expander.bias": ((kz * H,), "f32")})
    return t


def expected_keys(args, fp) -> dict:
    """key -> (gguf value type, value) per FORMAT.md."""
    U, F, S, A = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING,
                  gguf.GGUFValueType.ARRAY)
    a, arch = args, args.model_type
    k = {"general.architecture": (S, arch),
         f"{arch}.embedding_length": (U, a.dim), f"{arch}.block_count": (U, a.n_layer),
         f"{arch}.attention.head_count": (U, a.n_head), f"{arch}.attention.head_count_kv": (U, a.n_kv_head),
         f"{arch}.attention.key_length": (U, a.head_dim), f"{arch}.attention.value_length": (U, a.head_dim),
         f"{arch}.feed_forward_length": (U, a.ffn_dim),
         f"{arch}.attention.layer_norm_rms_epsilon": (F, pytest.approx(a.norm_eps, rel=1e-6)),
         f"{arch}.rope.freq_base": (F, a.rope_base), f"{arch}.vocab_size": (U, V),
         f"{arch}.block_size": (U, a.block_size), f"{arch}.target_layers": (A, list(a.target_layers)),
         f"{arch}.target_embedding_length": (U, a.target_dim),
         f"{arch}.draft_vocab_size": (U, a.draft_vocab_size),
         "blockspec.target.arch": (S, fp["arch"]), "blockspec.target.n_vocab": (U, fp["n_vocab"]),
         "blockspec.target.n_embd": (U, fp["n_embd"]), "blockspec.target.n_layer": (U, fp["n_layer"]),
         "blockspec.target.tokenizer_sha256": (S, fp["tokenizer_sha256"])}
    if arch == "specblock":
        k[f"{arch}.rank_widths"] = (A, list(a.rank_widths))
        k[f"{arch}.rank_top_k"] = (U, a.rank_top_k)
    else:
        k[f"{arch}.n_categories"] = (U, a.n_categories)
    return k


def run(model, embed, head, seed=1):
    """All logits of one packed training-style pass: 2 rows x 3 anchors over 12 context rows."""
    a = model.args
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(2, 12, len(a.target_layers) * a.target_dim, generator=g)
    anchors = torch.tensor([[2, 6, 10], [0, 5, 9]])
    last = torch.randint(0, V, (2, 3), generator=g)
    model.bind_target(embed, head)
    with torch.no_grad():
        out = model(feats, anchors, last)
    extra = out.rank_logits if a.model_type == "specblock" else out.prior_logits
    return out.logits.float(), extra.float()


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(case, outtype, targets, tmp_path):
    model = make_drafter(case)
    fp = target_fingerprint(targets["ok"])
    assert fp["n_vocab"] == V and fp["n_embd"] == H and fp["n_layer"] == NL and len(fp["tokenizer_sha256"]) == 64
    path = convert_drafter(model, tmp_path / f"{case}.{outtype}.gguf", outtype, target=targets["ok"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temp file left behind

    # layout, read by gguf-py's own reader
    r = gguf.GGUFReader(str(path))
    keys = {k: (f.types[0], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    want = expected_keys(model.args, fp)
    extra = set(keys) - set(want) - {"general.name", "general.file_type"}
    assert not extra and set(want) <= set(keys), (extra, set(want) - set(keys))
    for k, (vtype, val) in want.items():
        assert keys[k][0] == vtype and keys[k][1] == val, k
    for k in (f"{model.args.model_type}.target_layers", f"{model.args.model_type}.rank_widths"):
        if k in r.fields:
            assert r.fields[k].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    layout = expected_layout(model.args)
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(layout)
    mat = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[outtype]
    for name, (shape, kind) in layout.items():
        t = got[name]
        assert tuple(int(s) for s in t.shape) == tuple(reversed(shape)), name  # ggml ne0 first
        assert t.tensor_type.name == {"mat": mat, "f32": "F32", "i32": "I32"}[kind], name
    if model.args.draft_vocab_size:  # ABSOLUTE target ids
        assert np.array_equal(np.asarray(got["d2t"].data), model.vocab.d2t.numpy())

    # the rebuilt module computes what the original did
    loaded, meta = read_drafter_gguf(path)
    assert meta["model_args"] == dataclasses.asdict(model.args)
    light = read_drafter_meta(path)["model_args"]
    assert light == {k: v for k, v in meta["model_args"].items() if k in light}
    assert meta["target_fingerprint"] == fp and meta["outtype"] == outtype
    g = torch.Generator().manual_seed(3)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) / H ** 0.5
    ref, ref_extra = run(model, embed, head)
    new, new_extra = run(loaded, embed, head)
    tol, agree = TOL[outtype]
    if outtype == "f32":
        assert torch.equal(ref, new) and torch.equal(ref_extra, new_extra)
    else:
        scale = ref.abs().max()
        assert (ref - new).abs().max() <= tol * scale
        assert (ref_extra - new_extra).abs().max() <= tol * max(ref_extra.abs().max(), 1e-3) + 1e-6
        assert (ref.argmax(-1) == new.argmax(-1)).float().mean() >= agree


def test_q8_0_falls_back_to_f16_for_short_rows(targets, tmp_path):
    """A row length that is not a multiple of 32 cannot be Q8_0: those matrices are written F16."""
    torch.manual_seed(0)
    m = build_model({**TINY, **CASES["specblock"], "ffn_dim": 80})
    path = convert_drafter(m, tmp_path / "d.gguf", "q8_0", target=targets["ok"])
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.ffn_down.weight"] == "F16"  # rows of 80
    assert types["blk.0.ffn_up.weight"] == "Q8_0"  # rows of 64
    assert read_drafter_gguf(path)[0].args.ffn_dim == 80


def test_checkpoint_dir_records_its_target(targets, tmp_path):
    """convert_drafter(ckpt_dir) rebuilds the drafter from the checkpoint alone and fingerprints the
    target its training config names; with none recorded and none given it says so in one line."""
    from safetensors.torch import save_file

    model = make_drafter("dblast-kz4-dv")
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "drafter.safetensors"))
    meta = dict(model_args=dataclasses.asdict(model.args), config=dict(target=str(targets["ok"])), step=1)
    (d / "drafter.json").write_text(json.dumps(meta))
    out = convert_drafter(d, tmp_path / "out" / "d.gguf", "f32")
    assert torch.equal(read_drafter_gguf(out)[0].category_expander.weight, model.category_expander.weight)
    meta["config"] = {}
    (d / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(BlockspecError, match="no target GGUF") as e:
        convert_drafter(d, tmp_path / "x.gguf")
    assert "\n" not in str(e.value)
    with pytest.raises(BlockspecError, match="unknown outtype"):
        convert_drafter(d, tmp_path / "x.gguf", "q4_0", target=targets["ok"])


@pytest.mark.parametrize("target,words", [
    ("tokenizer", "another tokenizer"),
    ("width", "width"),
    ("vocab", "vocabulary of 256"),
    ("layers", "[2, 3] out of range"),
])
def test_wrong_target_refused_with_one_line(targets, tmp_path, target, words):
    model = make_drafter("specblock")
    path = convert_drafter(model, tmp_path / "d.gguf", "f16", target=targets["ok"])
    meta = read_drafter_meta(path)  # no torch: what the ggml backend checks at load
    with pytest.raises(BlockspecError) as e:
        check_pairing(meta, target_fingerprint(targets[target]))
    assert words in str(e.value) and "\n" not in str(e.value)
    # the converter refuses the pairing too, and writes nothing
    if target != "tokenizer":
        with pytest.raises(BlockspecError, match=words.replace("[", r"\[")):
            convert_drafter(model, tmp_path / "bad.gguf", "f16", target=targets[target])
        assert not (tmp_path / "bad.gguf").exists()
    check_pairing(meta, target_fingerprint(targets["ok"]))  # the right one passes


def test_truncated_or_corrupt_gguf_is_one_line(targets, tmp_path):
    from blockspec.runtime.engine.setup import make_drafter as runtime_drafter

    path = convert_drafter(make_drafter("dblast-kz4-dv"), tmp_path / "d.gguf", "q8_0", target=targets["ok"])
    blob = path.read_bytes()
    cases = {"half": blob[:len(blob) // 2], "header": blob[:200], "tiny": blob[:3],
             "lastbyte": blob[:-1], "magic": b"GGUX" + blob[4:]}
    for name, data in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(data)
        for load in (read_drafter_gguf, lambda p: runtime_drafter("dblast", str(p), "torch")):
            with pytest.raises(BlockspecError) as e:
                load(bad)
            msg = str(e.value)
            assert "\n" not in msg and str(bad) in msg, (name, msg)
    # a GGUF of our arch that lacks a key names the key
    w = gguf.GGUFWriter(str(tmp_path / "nokey.gguf"), "specblock")
    w.add_uint32("specblock.embedding_length", H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(BlockspecError, match="key specblock.block_count is missing"):
        read_drafter_gguf(tmp_path / "nokey.gguf")
    # a target GGUF is not a drafter
    with pytest.raises(BlockspecError, match="not a blockspec drafter"):
        read_drafter_gguf(targets["ok"])
    (tmp_path / "t.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(BlockspecError, match="truncated or corrupt"):
        target_fingerprint(tmp_path / "t.gguf")


def test_registered_converters():
    assert set(CONVERTERS) == {"specblock", "dblast"}
    assert all(c.arch == k for k, c in CONVERTERS.items())


def test_gguf_drafter_in_engine_equals_plain(smollm2_path, tmp_path):
    """A GGUF drafter runs in the torch backend against the real target: output == plain greedy;
    a drafter whose recorded tokenizer differs is refused at bind time with one line."""
    from blockspec.runtime.engine.setup import make_drafter as runtime_drafter
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.llama.target import Target, TargetConfig

    torch.manual_seed(0)
    smol = dict(dim=576, target_dim=576, n_head=9, n_kv_head=3, head_dim=64, ffn_dim=1536, vocab_size=49152,
                n_layer=1, draft_vocab_size=512, model_type="specblock", block_size=3, target_layers=[1, 15, 29])
    model = build_model(smol)
    path = convert_drafter(model, tmp_path / "sb.q8_0.gguf", "q8_0", target=smollm2_path)
    fp = target_fingerprint(smollm2_path)
    wrong = dict(fp, tokenizer_sha256="0" * 64)
    bad = CONVERTERS["specblock"](model, wrong, "f32").write(tmp_path / "wrong.gguf")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with Target(smollm2_path, TargetConfig(n_ctx=256, n_seq_max=4, n_threads=1)) as t:
            prompt = t.tokenize("The capital of France is", add_special=True)
            greedy = SamplingParams(temperature=0.0)
            plain = generate(t, prompt, max_tokens=12, sampling=greedy)
            spec = generate(t, prompt, max_tokens=12, sampling=greedy,
                            drafter=runtime_drafter("specblock", str(path), "torch"))
            assert spec.tokens == plain.tokens
            with pytest.raises(BlockspecError) as e:
                generate(t, prompt, max_tokens=4, sampling=greedy,
                         drafter=runtime_drafter("specblock", str(bad), "torch"))
            assert "another tokenizer" in str(e.value) and "\n" not in str(e.value)
    finally:
        torch.set_num_threads(n)


def test_read_gguf_tensors_equals_gguf_reader(targets, tmp_path):
    """The header-only tensor reader (used to share the target's embeddings) returns what
    gguf.GGUFReader + dequantize return, for F32, F16, Q8_0 and I32 tensors; absent names are skipped."""
    from blockspec.runtime.format.drafter_gguf import read_gguf_tensors
    from blockspec.models.target import dequantize_tensor

    path = convert_drafter(make_drafter("specblock-dv"), tmp_path / "d.gguf", "q8_0", target=targets["ok"])
    for f in (path, targets["ok"]):
        ref = {t.name: np.asarray(t.data) if t.tensor_type.name == "I32" else dequantize_tensor(t)
               for t in gguf.GGUFReader(str(f)).tensors}
        got = read_gguf_tensors(f, list(ref) + ["nope"])
        assert set(got) == set(ref)
        for k in ref:
            assert got[k].dtype == ref[k].dtype and np.array_equal(got[k], ref[k]), k
