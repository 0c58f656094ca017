"""Building blocks shared by the torch target and the drafters.

Only plain ops a ggml graph has one-to-one: linear, RMSNorm, rope (normal or NEOX), softmax
attention with an additive mask, SiLU-gated MLP. Keeping to these lets a later ggml drafter graph
mirror the torch modules op for op, and the torch side stay the numerical oracle.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn


def args_from_dict(cls, params: Mapping[str, Any]):
    """Build dataclass `cls` from `params`, dropping keys it does not know (checkpoints written by
    newer code, or run configs mixed into the same dict, still load)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in params.items() if k in names})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 like ggml_rms_norm, whatever the activation dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, base: float, dtype=torch.float32):
    """cos/sin tables for `positions` [..., T] -> two [..., T, head_dim/2] tensors.
    theta_i = pos * base^(-2i/d), the formula llama.cpp's ggml_rope uses (no scaling)."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    ang = positions.to(torch.float64)[..., None] * inv  # [..., T, D/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate x [B, n_head, T, D] by cos/sin [B or 1, T, D/2].

    neox=False is llama.cpp's "normal" mode: pairs are adjacent (x[2i], x[2i+1]); this is what a
    llama-arch GGUF needs, because convert_hf_to_gguf permuted its Q/K rows into that layout.
    neox=True pairs x[i] with x[i + D/2] (qwen2/qwen3, and all drafters)."""
    cos = cos[:, None].to(x.dtype)  # [B, 1, T, D/2]
    sin = sin[:, None].to(x.dtype)
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.flatten(-2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with grouped KV. q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], mask: bool
    [B or 1, 1, Tq, Tk] (True = visible) or None. Returns [B, Tq, Hq*D]."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(q.shape[-1]))
    return out.transpose(1, 2).flatten(2)


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, linear=nn.Linear):
        super().__init__()
        self.gate_proj = linear(dim, hidden, bias=bias)
        self.up_proj = linear(dim, hidden, bias=bias)
        self.down_proj = linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def default_layers(n_layer: int, n: int) -> list[int]:
    """`n` target layer ids spread from low to top, as layer-INPUT ids (0 = embeddings,
    n_layer = output of the last block). Skips 0 (embeddings carry no context) and ends at the input
    of the last block, matching the taps llama.cpp exposes (0 <= L < n_layer)."""
    if n == 1:
        return [n_layer - 1]
    return sorted({round(1 + i * (n_layer - 2) / (n - 1)) for i in range(n)})


def resolve_device(name: str = "auto") -> "torch.device":
    """The torch device `--device` names: auto = the first CUDA (or ROCm) device when this torch has
    one, else the CPU. BlockspecError, one line, for a device this torch cannot use."""
    from blockspec.runtime.errors import BlockspecError

    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise BlockspecError(f"--device {name!r}: not a device (auto, cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BlockspecError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device; install "
                                 f"a CUDA build of torch (README, GPU builds) or use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise BlockspecError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise BlockspecError(f"--device {name}: drafters train on cpu or cuda (ROCm builds of torch count as cuda)")
    return dev
