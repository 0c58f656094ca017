"""z-lab DFlash Hugging Face checkpoint -> our DBlast (n_categories = 1, i.e. plain DFlash).

z-lab/dflash `DFlashDraftModel` (a Qwen3 stack) and our DBlast compute the same thing up to the
points below; the mapping refuses, with one line naming the difference, whatever it cannot carry
exactly.

  theirs (state_dict, optional "model." prefix)        ours (DBlast state_dict)
  fc.weight  [H, L*Ht]                                  fc.weight
  hidden_norm.weight                                    cond_norm.weight
  layers.i.input_layernorm.weight                       layers.i.attn_norm.weight
  layers.i.self_attn.{q,k,v,o}_proj.weight              layers.i.attn.{wq,wk,wv,wo}.weight
  layers.i.post_attention_layernorm.weight              layers.i.ffn_norm.weight
  layers.i.mlp.{gate,up,down}_proj.weight               layers.i.ffn.{gate,up,down}_proj.weight
  norm.weight                                           norm.weight
  lm_head.weight (if any)                               vocab.lm_head.weight, d2t = arange(V)
  target's embed row [mask_token_id] (or mask_embedding.pt)   mask_embedding

Conventions checked here:
  * target layers: their `target_layer_ids` index HF `hidden_states[id + 1]` = the INPUT of target
    layer id + 1, so ours (layer-input ids) are id + 1 -- the same +1 upstream's converter writes
    as its extract ids. id + 1 must be < the target's n_layer (HF's hidden_states[n_layer] is
    after the final norm, which no tap of ours reads).
  * rope: both NEOX (rotate_half) on absolute positions, context rows at their own positions, the
    block [last, MASK...] at last_pos .. last_pos + B - 1; non-causal block attention over all
    context rows; scale head_dim^-0.5; SiLU-gated MLP; one rms eps for every norm. Same.
  * QK-norm: DFlash RMS-normalises q and k per head (Qwen3 q_norm/k_norm), context k included,
    before rope; a checkpoint with q_norm/k_norm becomes a DBlast with qk_norm = True (same order).
  * also refused: attention biases, non-SiLU activations, rope scaling, sliding-window layers,
    embedding/logit/value scales, an own embed_tokens table.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from blockspec.runtime.errors import BlockspecError

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.gate_proj.weight",
    "mlp.up_proj.weight": "ffn.up_proj.weight",
    "mlp.down_proj.weight": "ffn.down_proj.weight",
}
_TOP = {"fc.weight": "fc.weight", "hidden_norm.weight": "cond_norm.weight", "norm.weight": "norm.weight",
        "lm_head.weight": "vocab.lm_head.weight"}
# DFlash's per-head q/k RMS norms, mapped only when our attention has them
_QK_NORM = {"self_attn.q_norm.weight": "attn.q_norm.weight", "self_attn.k_norm.weight": "attn.k_norm.weight"}


def _config(ckpt_dir: Path) -> dict:
    p = ckpt_dir / "config.json"
    return json.loads(p.read_text()) if p.is_file() else {}


def is_dflash_hf(ckpt_dir: str | os.PathLike) -> bool:
    """A z-lab-style DFlash HF checkpoint: config.json with dflash_config or a DFlash architecture."""
    cfg = _config(Path(ckpt_dir))
    return "dflash_config" in cfg or any("DFlash" in a for a in cfg.get("architectures", []))


def build_target_layer_ids(n_target_layers: int, n_draft_layers: int) -> list[int]:
    """DFlash's default feature layers (HF hidden-state ids minus one) when the config names none:
    spread evenly over 1 .. n_target_layers - 3, or the middle layer for a 1-layer draft."""
    if n_draft_layers == 1:
        return [n_target_layers // 2]
    start, end = 1, n_target_layers - 3
    return [int(round(start + i * (end - start) / (n_draft_layers - 1))) for i in range(n_draft_layers)]


def _refuse(what: str) -> None:
    raise BlockspecError(f"cannot map this DFlash checkpoint onto blockspec DBlast exactly: {what}")


def map_state_dict(state: dict, n_layer: int) -> dict:
    """Their tensor names -> ours; refuses unknown tensors."""
    out = {}
    for name, t in state.items():
        n = name[len("model."):] if name.startswith("model.") else name
        if n in _TOP:
            out[_TOP[n]] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", n)
        if m and int(m.group(1)) < n_layer:
            rest = m.group(2)
            if rest in _LAYER:
                out[f"layers.{m.group(1)}.{_LAYER[rest]}"] = t
                continue
            if rest in _QK_NORM:
                out[f"layers.{m.group(1)}.{_QK_NORM[rest]}"] = t
                continue
            if rest.endswith(".bias"):
                _refuse(f"tensor {name} (DBlast has no biases in its layers)")
        if n == "embed_tokens.weight":
            _refuse("it carries its own embed_tokens table (DBlast embeds with the target's table)")
        _refuse(f"unexpected tensor {name}")
    return out


def _check_config(cfg: dict) -> None:
    dc = cfg.get("dflash_config", {})
    if cfg.get("attention_bias"):
        _refuse("attention_bias = true")
    if cfg.get("mlp_bias"):
        _refuse("mlp_bias = true")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        _refuse(f"hidden_act {act!r} (DBlast uses SiLU)")
    rope = cfg.get("rope_scaling") or {}
    rtype = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
    if rtype not in (None, "default"):
        _refuse(f"rope scaling {rtype!r}")
    if (cfg.get("use_sliding_window") or dc.get("use_swa")) and (dc.get("swa_window_size") or cfg.get("sliding_window")):
        _refuse("sliding-window attention layers")
    if any(lt == "sliding_attention" for lt in cfg.get("layer_types") or []) and cfg.get("use_sliding_window"):
        _refuse("sliding-window attention layers")
    if cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor"):
        _refuse("partial rotary embedding")
    for k in ("attention_value_scale", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
              "conv_kernel_size", "selector_rank"):
        if dc.get(k) is not None or (k != "conv_kernel_size" and cfg.get(k) is not None):
            _refuse(f"{k} (DFlash2/scaled variants are not DBlast)")
    if dc.get("causal") or cfg.get("is_causal"):
        _refuse("causal block attention (DBlast's block is bidirectional)")


def _read_safetensors(ckpt_dir: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise BlockspecError(f"{ckpt_dir} has no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _target_info(target_gguf: str | os.PathLike):
    """(n_layer, n_embd, n_vocab, token_embd [V, H] float32 numpy) of a target GGUF."""
    import gguf
    import numpy as np

    from blockspec.models.target import dequantize_tensor, read_gguf_args

    r = gguf.GGUFReader(str(target_gguf))
    a = read_gguf_args(r)
    emb = next(t for t in r.tensors if t.name == "token_embd.weight")
    return a, np.asarray(dequantize_tensor(emb))


def load_dflash_hf(ckpt_dir: str | os.PathLike, target_gguf: str | os.PathLike):
    """Build a DBlast (n_categories = 1) holding a z-lab DFlash checkpoint's weights, exactly,
    or raise BlockspecError naming the first difference that makes that impossible."""
    import torch

    from blockspec.models.dblast import DBlast, ModelArgs

    d = Path(ckpt_dir)
    cfg = _config(d)
    if not cfg:
        raise BlockspecError(f"{d} has no config.json")
    _check_config(cfg)
    dc = cfg.get("dflash_config", {})
    H, L = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    n_head = int(cfg["num_attention_heads"])
    state = _read_safetensors(d)
    mapped = map_state_dict(state, L)

    targs, embed = _target_info(target_gguf)
    if targs.dim != H:
        _refuse(f"draft hidden_size {H} != target n_embd {targs.dim} (DBlast runs at the target's width)")
    n_feat = mapped["fc.weight"].shape[1] // targs.dim
    ids = dc.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        ids = build_target_layer_ids(int(cfg.get("num_target_layers", targs.n_layer)), L)
    ours = [int(i) + 1 for i in ids]  # HF hidden_states[id + 1] = input of layer id + 1
    if len(ours) != n_feat:
        _refuse(f"fc takes {n_feat} target layers but target_layer_ids lists {len(ours)}")
    if max(ours) >= targs.n_layer:
        _refuse(f"target layer id {max(ours) - 1} reads HF hidden_states[{max(ours)}], past the last tappable "
                f"layer input ({targs.n_layer - 1}) of this {targs.n_layer}-layer target")

    mask_id = dc.get("mask_token_id", cfg.get("mask_token_id"))
    mask_pt = d / "mask_embedding.pt"
    if mask_pt.is_file():
        m = torch.load(mask_pt, map_location="cpu", weights_only=True)
        mask = m["embedding"].float()
    elif mask_id is not None:
        if not 0 <= int(mask_id) < embed.shape[0]:
            _refuse(f"mask_token_id {mask_id} is outside the target vocabulary ({embed.shape[0]})")
        mask = torch.from_numpy(embed[int(mask_id)].copy())
    else:
        _refuse("no mask_token_id in dflash_config and no mask_embedding.pt")

    head_dim = int(cfg.get("head_dim") or H // n_head)
    vd = mapped["vocab.lm_head.weight"].shape[0] if "vocab.lm_head.weight" in mapped else 0
    args = ModelArgs(
        dim=H, n_layer=L, n_head=n_head, n_kv_head=int(cfg.get("num_key_value_heads", n_head)), head_dim=head_dim,
        ffn_dim=int(cfg["intermediate_size"]), vocab_size=targs.vocab_size, draft_vocab_size=vd,
        target_layers=ours, target_dim=targs.dim, block_size=int(dc.get("block_size", cfg.get("block_size", 16))),
        n_categories=1, rope_base=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), qk_norm="layers.0.attn.q_norm.weight" in mapped)
    model = DBlast(args)
    mapped["mask_embedding"] = mask
    if vd:
        mapped["vocab.d2t"] = torch.arange(vd, dtype=torch.long)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in mapped.items()}, strict=False)
    missing = [k for k in missing if k not in ("target_embed", "target_head")]
    if missing:
        raise BlockspecError(f"DFlash checkpoint {d} lacks tensors for {missing[0]} (and {len(missing) - 1} more)")
    return model.eval()
