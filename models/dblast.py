"""DBlast drafter: a DFlash-style block-diffusion drafter made dependent by a categorical latent.

Per block anchored at context position t (see drafter.py):
  c          = cond_norm(fc([h_1; ..; h_5]))     # ~5 target layers fused; each draft layer
                                                 # projects c to its own context K/V (DFlash)
  block      = [embed(x[t+1]), mask_embedding x (B-1)] at positions t+1 .. t+B,
               bidirectional inside the block, one pass -> states h [B, N, B, H]
  prior      = category_prior(norm(h[0]))        # q(z | y) over Kz categories
  h_z[j]     = h[j] + category_expander(h[j])[z] # z-specific offsets, j = 1..B-1
  logits_z[j]= head(norm(h_z[j]))                # q_j(x[t+1+j] | y, z)
so q(x_1..P | y) = sum_z q(z|y) prod_j q_j(x_j | y, z): a CP mixture whose components are
coherent branches. Kz = 1 drops the prior and the expander and is plain DFlash.
Inference samples z ~ softmax(prior / Z_T) and greedily decodes that branch; n samples give n
branches. The mask token is a learned embedding (`mask_embedding`), not a vocabulary entry, so any
target works without a reserved token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import torch
from torch import nn

from .common import args_from_dict
from .drafter import BlockDrafter, DraftCache, block_mask


@dataclass
class ModelArgs:
    model_type: str = "dblast"
    dim: int = 576
    n_layer: int = 2
    n_head: int = 9
    n_kv_head: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    vocab_size: int = 49152
    draft_vocab_size: int = 0
    target_layers: list = field(default_factory=lambda: [1, 8, 15, 22, 29])
    target_dim: int = 576
    block_size: int = 5                 # B: the block is [last, MASK x (B-1)] -> B-1 drafted tokens
    n_categories: int = 1               # Kz; 1 = plain DFlash
    qk_norm: bool = False               # per-head q/k RMSNorm (DFlash's; exports to upstream exactly)
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        return args_from_dict(cls, params)

    @property
    def n_predict(self) -> int:
        return self.block_size - 1


class DBlastOutput(NamedTuple):
    hidden: torch.Tensor        # [B, N, P, H] shared (pre-expansion) states of the MASK rows
    logits: torch.Tensor        # [B, N, Kz, P, Vd]
    prior_logits: torch.Tensor  # [B, N, Kz] (zeros when Kz = 1)


class DBlast(BlockDrafter):
    causal = False

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        H, Kz = args.dim, args.n_categories
        self.mask_embedding = nn.Parameter(torch.randn(H) * 0.02)
        if Kz > 1:
            self.category_prior = nn.Linear(H, Kz, bias=True)
            # small random init: identical branches would get identical gradients forever
            self.category_expander = nn.Linear(H, Kz * H, bias=True)
            nn.init.normal_(self.category_expander.weight, 0.0, 0.02 / H ** 0.5)
            nn.init.normal_(self.category_expander.bias, 0.0, 0.02)
        else:
            self.category_prior = None
            self.category_expander = None

    def states(self, feats, anchors, last_tokens, cache=None) -> torch.Tensor:
        """Pre-norm block states [B, N, B, H] (row 0 = the last token, rows 1.. = MASK)."""
        a = self.args
        B, N = anchors.shape
        Bk, H = a.block_size, a.dim
        ks, vs, cond = self.context(self.condition(feats), cache)
        S = cond.shape[1]
        first = self.embed(last_tokens)[:, :, None, :]  # [B, N, 1, H]
        masks = self.mask_embedding.to(first.dtype).expand(B, N, Bk - 1, H)
        x = torch.cat([first, masks], dim=2)
        x = x.reshape(B, N * Bk, H)
        pos = (anchors[..., None] + 1 + torch.arange(Bk, device=anchors.device)).reshape(B, N * Bk)
        mask = block_mask(anchors, S, Bk, causal=False)
        for i, layer in enumerate(self.layers):
            x = layer(x, pos, ks[i], vs[i], mask)
        return x.view(B, N, Bk, H)

    def branch_logits(self, h: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor:
        """h [B, N, P, H] MASK-row states -> logits [B, N, Kz, P, V] for every category (z None),
        or [B, N, n, P, V] for the chosen categories z [B, N, n]."""
        Kz, H = self.args.n_categories, self.args.dim
        if self.category_expander is None:
            n = 1 if z is None else z.shape[2]
            off = torch.zeros_like(h)[:, :, None].expand(-1, -1, n, -1, -1)  # [B, N, n, P, H]
        else:
            off = self.category_expander(h).view(*h.shape[:3], Kz, H).permute(0, 1, 3, 2, 4)
            if z is not None:
                idx = z[:, :, :, None, None].expand(-1, -1, -1, h.shape[2], H)
                off = off.gather(2, idx)
        return self.logits(self.norm(h[:, :, None] + off))

    def prior(self, h0: torch.Tensor) -> torch.Tensor:
        if self.category_prior is None:
            return torch.zeros(*h0.shape[:2], 1, dtype=h0.dtype, device=h0.device)
        return self.category_prior(self.norm(h0))

    def forward(self, feats, anchors, last_tokens, cache: DraftCache | None = None) -> DBlastOutput:
        x = self.states(feats, anchors, last_tokens, cache)
        h = x[:, :, 1:]
        return DBlastOutput(h, self.branch_logits(h, None), self.prior(x[:, :, 0]))

    @torch.no_grad()
    def propose(self, feats, anchors, last_tokens, cache=None, n_branches: int = 1, z_temperature: float = 1.0,
                generator: torch.Generator | None = None):
        """n_branches blocks per anchor: z ~ softmax(prior / Z_T) (Z_T = 0: the most likely
        categories), each branch decoded greedily. -> tokens [B, N, n, P] (target ids), z [B, N, n]."""
        logits, z = self.propose_logits(feats, anchors, last_tokens, cache, n_branches, z_temperature, generator)
        return self.vocab.to_target(logits.argmax(-1)), z

    def propose_logits(self, feats, anchors, last_tokens, cache=None, n_branches: int = 1,
                       z_temperature: float = 1.0, generator: torch.Generator | None = None):
        """`propose`'s branches before the argmax: logits [B, N, n, P, Vd] (draft ids), z [B, N, n]."""
        x = self.states(feats, anchors, last_tokens, cache)
        prior = self.prior(x[:, :, 0]).float()  # [B, N, Kz]
        B, N, Kz = prior.shape
        if Kz == 1:
            z = torch.zeros(B, N, n_branches, dtype=torch.long, device=prior.device)
        elif z_temperature <= 0:
            z = prior.topk(min(n_branches, Kz), dim=-1).indices
        else:
            probs = torch.softmax(prior / z_temperature, dim=-1).view(B * N, Kz)
            z = torch.multinomial(probs, n_branches, replacement=True, generator=generator).view(B, N, -1)
        return self.branch_logits(x[:, :, 1:], z), z


Model = DBlast
