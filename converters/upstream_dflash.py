"""Export a DBlast drafter in upstream llama.cpp's own `dflash` GGUF layout, so upstream's DFlash
engine (`--spec-type draft-dflash`) can run OUR weights (the benchmark peer "same weights, their
engine against ours"), and so our ggml backend runs DBlast in that graph (runtime/drafters/ggml_backend.py).

What upstream's loader and graph need (pinned source: src/models/dflash.cpp, src/llama-model.cpp,
common/speculative.cpp, conversion/qwen.py DFlashModel) and how each is written:

  dflash.target_layers     upstream extract ids = the target layer whose INPUT is captured
                           (llama_set_embeddings_layer_inp); upstream's converter writes HF ids + 1.
                           Ours are layer-input ids already, so they are written as they are.
  dflash.block_size        B (the block [last, MASK x (B-1)] drafts B-1 tokens, as ours).
  fc / enc.output_norm     our fc / cond_norm: c = rms_norm(fc(concat features)) * w. Same.
  blk.i.*                  one-to-one (attn_norm, attn_q/k/v/output, ffn_norm, ffn_gate/up/down).
  output_norm              our final norm.
  mask                     upstream embeds a mask TOKEN id (`tokenizer.ggml.mask_token_id`) with the
                           draft's own `token_embd` when present. We append one control token
                           "<|blockspec_mask|>" (id = n_vocab) to the copied target tokenizer and
                           write token_embd = [target embeddings; our mask_embedding] ([V+1, H]),
                           so the block input is exactly ours (token_embd follows --outtype:
                           f32 keeps the target's dequantized rows bit for bit). A draft with its own token_embd would
                           tie its head to it, so `output` is written too: the target's head bytes
                           as they are (or our reduced head), with d2t (I64, absolute target ids,
                           upstream's reduced-vocab scatter) so logits cover V+1 ids and the mask id
                           gets -inf. The draft vocab differs from the target's by one token, inside
                           upstream's compatibility slack (128).
  context K/V              K = rope(k_norm(wk c)), V = wv c at the context rows' own positions:
                           the same injection as our DraftCache (rope NEOX on absolute positions,
                           1/sqrt(head_dim) scale, non-causal block over all context rows).

Two things are blockspec's own, added to the dflash arch by ggml_patches/0008 (in the pinned
build, so the bench's upstream tools have them too):
  q/k norm                 upstream always RMS-normalises q and k per head (attn_q_norm/attn_k_norm
                           required). A DBlast trained with `--qk-norm` writes them; one without
                           omits them, and the patched graph skips the norm, so both run exactly.
  categories (Kz > 1)      blockspec.category_prior.{weight,bias} [H -> Kz] and
                           blockspec.category_expander.{weight,bias} [H -> Kz*H]: the graph gives the
                           prior of the block's first row and, for the branches z set with
                           blockspec_set_branch_z, the drafted rows' logits from h + expander(h)[z]
                           (outputs "category_prior", "branch_logits"; no ordinary logits, so
                           upstream's own engine cannot run a Kz > 1 export: our ggml backend does).
                           A Kz = 1 export is plain DFlash, unchanged.
Exactness: tests/test_converters.py and tests/test_ggml_dflash.py run the graph in process on such
exports against our module (f16 K/V rounding only).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.drafter_gguf import gguf_writer

ARCH = "dflash"
MASK_TOKEN_TEXT = "<|blockspec_mask|>"
TOKEN_TYPE_CONTROL = 3
_LAYER = {
    "attn_norm.weight": "attn_norm.weight", "attn.wq.weight": "attn_q.weight", "attn.wk.weight": "attn_k.weight",
    "attn.wv.weight": "attn_v.weight", "attn.wo.weight": "attn_output.weight", "attn.q_norm.weight": "attn_q_norm.weight",
    "attn.k_norm.weight": "attn_k_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "ffn.gate_proj.weight": "ffn_gate.weight", "ffn.up_proj.weight": "ffn_up.weight",
    "ffn.down_proj.weight": "ffn_down.weight",
}
_TOP = {"fc.weight": "fc.weight", "cond_norm.weight": "enc.output_norm.weight", "norm.weight": "output_norm.weight",
        "vocab.lm_head.weight": "output.weight", "mask_embedding": None, "vocab.d2t": None,
        **{f"category_{part}.{p}": f"blockspec.category_{part}.{p}"
           for part in ("prior", "expander") for p in ("weight", "bias")}}


def gguf_name(torch_name: str) -> str | None:
    """Upstream dflash tensor name of a DBlast state_dict entry (None: written separately)."""
    if torch_name in _TOP:
        return _TOP[torch_name]
    parts = torch_name.split(".", 2)
    if parts[0] == "layers" and parts[2] in _LAYER:
        return f"blk.{int(parts[1])}.{_LAYER[parts[2]]}"
    raise BlockspecError(f"upstream dflash has no tensor for DBlast's {torch_name!r}")


def _encode(w, name: str, arr: np.ndarray, outtype: str) -> None:
    """Add a float tensor: 1-D stays F32; 2-D follows outtype (q8_0 only where rows allow it)."""
    import gguf

    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if arr.ndim == 1 or outtype == "f32":
        w.add_tensor(name, arr)
    elif outtype == "f16":
        w.add_tensor(name, arr.astype(np.float16))
    elif outtype == "q8_0" and arr.shape[-1] % 32 == 0:
        q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
        w.add_tensor(name, arr.astype(np.float16))


def _load_model(model_or_ckpt):
    """A drafter module, a `blockspec train` checkpoint dir or a blockspec drafter GGUF -> module."""
    if isinstance(model_or_ckpt, (str, os.PathLike)):
        from blockspec.models.checkpoint import load_checkpoint

        return load_checkpoint(model_or_ckpt)[0]
    return model_or_ckpt


def export_upstream_dflash(model_or_ckpt, out_path: str | os.PathLike, target: str | os.PathLike,
                           outtype: str = "f16") -> Path:
    """DBlast (module or checkpoint dir) + its target GGUF -> an upstream `dflash` GGUF."""
    import gguf

    from blockspec.models.target import dequantize_tensor, read_gguf_args

    model = _load_model(model_or_ckpt)
    a = model.args
    if getattr(a, "model_type", "") != "dblast":
        raise BlockspecError(f"--layout upstream-dflash exports DBlast drafters only, not {a.model_type!r}")
    if outtype not in ("f32", "f16", "q8_0"):
        raise BlockspecError(f"unknown outtype {outtype!r} (f32, f16, q8_0)")
    tr = gguf.GGUFReader(str(target))
    ta = read_gguf_args(tr)
    if ta.dim != a.target_dim or ta.vocab_size != a.vocab_size:
        raise BlockspecError(f"drafter was built for a target of width {a.target_dim} and vocab {a.vocab_size}, "
                             f"{target} has {ta.dim} and {ta.vocab_size}")
    if max(a.target_layers) >= ta.n_layer:
        raise BlockspecError(f"drafter taps layer {max(a.target_layers)} but {target} has {ta.n_layer} layers")
    tensors = {t.name: t for t in tr.tensors}
    V, H = ta.vocab_size, a.dim

    out = Path(out_path)
    with gguf_writer(out, ARCH) as w:
        w.add_name("blockspec DBlast (upstream dflash layout)")
        ctx_field = tr.fields.get(f"{ta.arch}.context_length")
        w.add_context_length(int(ctx_field.contents()) if ctx_field is not None else 4096)
        w.add_embedding_length(H)
        w.add_block_count(a.n_layer)
        w.add_feed_forward_length(a.ffn_dim)
        w.add_head_count(a.n_head)
        w.add_head_count_kv(a.n_kv_head)
        w.add_key_length(a.head_dim)
        w.add_value_length(a.head_dim)
        w.add_rope_dimension_count(a.head_dim)
        w.add_rope_freq_base(float(a.rope_base))
        w.add_layer_norm_rms_eps(float(a.norm_eps))
        w.add_uint32(f"{ARCH}.block_size", int(a.block_size))
        w.add_array(f"{ARCH}.target_layers", [int(x) for x in a.target_layers])
        w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7}[outtype])

        # tokenizer: the target's, plus one control token for the mask
        for name, field in tr.fields.items():
            if not name.startswith("tokenizer.") or name == "tokenizer.ggml.mask_token_id":
                continue
            vtype = field.types[0]
            val = field.contents()
            if name == "tokenizer.ggml.tokens":
                val = list(val) + [MASK_TOKEN_TEXT]
            elif name == "tokenizer.ggml.token_type":
                val = list(val) + [TOKEN_TYPE_CONTROL]
            elif name == "tokenizer.ggml.scores":
                val = list(val) + [0.0]
            sub = {"sub_type": field.types[-1]} if vtype == gguf.GGUFValueType.ARRAY else {}
            w.add_key_value(name, val, vtype, **sub)
        if len(tr.fields["tokenizer.ggml.tokens"].contents()) != V:
            raise BlockspecError(f"{target}: tokenizer lists a different number of tokens than token_embd rows ({V})")
        w.add_mask_token_id(V)

        # input table: target embeddings + our mask row
        emb = dequantize_tensor(tensors["token_embd.weight"])
        mask = model.mask_embedding.detach().float().cpu().numpy()
        _encode(w, "token_embd.weight", np.concatenate([emb, mask[None]], axis=0), outtype)
        del emb

        state = {k: v.detach().float().cpu().numpy() for k, v in model.export_state().items()
                 if k not in ("target_embed", "target_head")}
        if a.draft_vocab_size:
            d2t = state["vocab.d2t"].astype(np.int64)
        else:  # the target's head, bytes as they are: exactly what ctx_other sharing would use
            head = tensors.get("output.weight", tensors["token_embd.weight"])
            w.add_tensor("output.weight", np.asarray(head.data), raw_shape=np.asarray(head.data).shape,
                         raw_dtype=head.tensor_type)
            d2t = np.arange(V, dtype=np.int64)
        w.add_tensor("d2t", d2t)

        for name, arr in state.items():
            g = gguf_name(name)
            if g is not None:
                _encode(w, g, arr, outtype)
    return out


def cached_export(path: str | os.PathLike, target: str | os.PathLike) -> Path:
    """`path` as upstream's dflash engine reads it: a blockspec DBlast GGUF is exported to the
    upstream layout once (in the drafter's own type: f32, f16 or q8_0; cached by the content of
    drafter and target under $BLOCKSPEC_CACHE/exports); any other GGUF is taken as already upstream's."""
    import hashlib

    from blockspec.runtime.format.gguf_header import GGUFHeader
    from blockspec.runtime.format.modelfile import cache_dir

    fields = GGUFHeader(str(path)).fields
    if fields.get("general.architecture") != "dblast":
        return Path(path)
    outtype = {0: "f32", 1: "f16"}.get(fields.get("general.file_type"), "q8_0")
    h = hashlib.sha256()
    for p in (path, target):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    out = cache_dir() / "exports" / f"dflash-{h.hexdigest()[:16]}.gguf"
    if not out.is_file():
        export_upstream_dflash(path, out, target=target, outtype=outtype)
    return out
