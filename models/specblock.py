"""SpecBlock drafter (arXiv 2605.07243): one pass drafts a dependent block of K tokens.

Per block anchored at context position t (see drafter.py for the anchor convention):
  c_t      = cond_norm(fc([h_low; h_mid; h_top]_t))              # [B, N, H] conditioning
  x0[k]    = in_proj([c_t ; embed(x[t+1])]) + pos_query[k]       # prefix broadcast + K queries
  layer l  : x = DraftLayer_l(x)   (attends to the cached context K/V and causally in the block)
  shift    : x[k] = shift_l([x[k] ; x[k-1]])  (x[-1] = 0) before every layer after the first,
             so position k reads position k-1's state of the previous layer: in-block dependence in
             one parallel pass (the paper's layer-wise shift). Nothing flows from k to k-1.
  logits[k]= head(norm(x[k]))  predicts x[t+2+k]
  rank[k]  = rank_head([norm(x[k]) ; summary(softmax(logits[k]))]) -> 4 buckets; bucket b means
             "branch rank_widths[b] candidates here" (the dynamic tree).
The rank head reads detached inputs: it is a classifier on top of the drafter, trained by its own
cross-entropy, and must not bend the drafter toward being easy to classify.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .common import args_from_dict
from .drafter import BlockDrafter, DraftCache, block_mask, softmax_summary


@dataclass
class ModelArgs:
    model_type: str = "specblock"
    dim: int = 576                      # = target width (the drafter reads target embeddings)
    n_layer: int = 2
    n_head: int = 9
    n_kv_head: int = 3
    head_dim: int = 64
    ffn_dim: int = 1536
    vocab_size: int = 49152             # target vocabulary
    draft_vocab_size: int = 0           # 0: share the target's head
    target_layers: list = field(default_factory=lambda: [1, 15, 29])  # low / mid / top layer inputs
    target_dim: int = 576
    block_size: int = 4                 # K predicted tokens per pass
    rank_widths: list = field(default_factory=lambda: [1, 2, 4, 8])   # candidates per bucket b0..b3
    rank_top_k: int = 4
    rank_hidden: int = 64
    rope_base: float = 10000.0
    norm_eps: float = 1e-6

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        return args_from_dict(cls, params)

    @property
    def n_predict(self) -> int:
        return self.block_size


class SpecBlockOutput(NamedTuple):
    hidden: torch.Tensor       # [B, N, K, H] final-normed states
    logits: torch.Tensor       # [B, N, K, Vd]
    rank_logits: torch.Tensor  # [B, N, K, n_buckets]


class SpecBlock(BlockDrafter):
    causal = True

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        H, K = args.dim, args.block_size
        self.in_proj = nn.Linear(2 * H, H, bias=False)
        self.pos_query = nn.Parameter(torch.randn(K, H) * 0.02)
        self.shift = nn.ModuleList(nn.Linear(2 * H, H, bias=False) for _ in range(args.n_layer - 1))
        n_sum = 2 * args.rank_top_k
        self.rank_head = nn.Sequential(nn.Linear(H + n_sum, args.rank_hidden), nn.SiLU(),
                                       nn.Linear(args.rank_hidden, len(args.rank_widths)))
        self.reset_shift()

    def reset_shift(self) -> None:
        """Start each shift as [I, small]: the layer stack begins as a plain transformer and
        learns how much of position k-1 to mix in."""
        for lin in self.shift:
            self._start_shift(lin, 0.02 / self.args.dim ** 0.5)

    @staticmethod
    @torch.no_grad()
    def _start_shift(lin: nn.Linear, prev_std: float) -> None:
        """lin.weight = [I, N(0, prev_std)]: x[k] passes through, x[k-1] mixed in by that much."""
        H = lin.out_features
        lin.weight.zero_()
        lin.weight[:, :H].copy_(torch.eye(H))
        lin.weight[:, H:].normal_(0.0, prev_std)

    def resize_block(self, block_size: int) -> None:
        """K -> block_size: position queries beyond the trained ones start as copies of the last
        trained one (its neighbours' roles are the nearest); a smaller K keeps the first ones, which
        draft exactly what they did (the block is causal)."""
        old = self.pos_query.detach()
        k = old.shape[0]
        rows = [old[min(i, k - 1)] for i in range(int(block_size))]
        self.pos_query = nn.Parameter(torch.stack(rows).clone())
        super().resize_block(block_size)

    def grow_layers(self, n_layer: int) -> None:
        """New layers as BlockDrafter's; the shift before each starts as [I, 0] (position k-1 not
        mixed in yet), so the grown drafter drafts exactly what it did."""
        H = self.args.dim
        super().grow_layers(n_layer)
        while len(self.shift) < n_layer - 1:
            lin = nn.Linear(2 * H, H, bias=False).to(self.pos_query)
            self._start_shift(lin, 0.0)
            self.shift.append(lin)

    @staticmethod
    def shift_prev(x: torch.Tensor) -> torch.Tensor:
        """[B, N, K, H] -> the same with position k holding x[k-1] (zeros at k = 0)."""
        return F.pad(x, (0, 0, 1, 0))[:, :, :-1]

    def forward(self, feats: torch.Tensor, anchors: torch.Tensor, last_tokens: torch.Tensor,
                cache: DraftCache | None = None, cond_override: torch.Tensor | None = None,
                ctx_end: torch.Tensor | None = None) -> SpecBlockOutput:
        """feats [B, S, F]: target states of context positions (the new ones when `cache` is given;
        S may be 0); anchors [B, N] absolute context positions; last_tokens [B, N] = x[anchor+1];
        cond_override [B, N, H]: use these instead of c[anchor] (cross-block training);
        ctx_end [B, N]: the last context position each block may attend to (default: its anchor;
        a cross-block block anchored past the target's features sees only those that exist)."""
        a = self.args
        B, N = anchors.shape
        K, H = a.block_size, a.dim
        ks, vs, cond = self.context(self.condition(feats), cache)
        S = cond.shape[1]
        if cond_override is None:
            c = cond.gather(1, anchors[..., None].expand(B, N, H))  # [B, N, H]
        else:
            c = cond_override
        x = self.in_proj(torch.cat([c, self.embed(last_tokens)], dim=-1))  # [B, N, H]
        x = x[:, :, None, :] + self.pos_query  # [B, N, K, H] prefix broadcast + position queries
        pos = (anchors[..., None] + 1 + torch.arange(K, device=anchors.device)).reshape(B, N * K)
        mask = block_mask(anchors if ctx_end is None else ctx_end, S, K, causal=True)
        for i, layer in enumerate(self.layers):
            if i > 0:
                x = self.shift[i - 1](torch.cat([x, self.shift_prev(x)], dim=-1))
            x = layer(x.reshape(B, N * K, H), pos, ks[i], vs[i], mask).view(B, N, K, H)
        h = self.norm(x)
        logits = self.logits(h)
        summary = softmax_summary(logits.detach(), a.rank_top_k)
        rank_logits = self.rank_head(torch.cat([h.detach(), summary.to(h.dtype)], dim=-1))
        return SpecBlockOutput(h, logits, rank_logits)

    @torch.no_grad()
    def propose(self, feats, anchors, last_tokens, cache=None):
        """Greedy block in target ids [B, N, K] and the bucket widths [B, N, K] of the tree."""
        out = self(feats, anchors, last_tokens, cache)
        tokens = self.vocab.to_target(out.logits.argmax(-1))
        widths = torch.tensor(self.args.rank_widths, device=tokens.device)[out.rank_logits.argmax(-1)]
        return tokens, widths


def rank_bucket_labels(logits: torch.Tensor, labels: torch.Tensor, widths) -> torch.Tensor:
    """Bucket label of each position: the smallest bucket whose candidate width covers the rank of
    the target token among the drafter's candidates (rank 0 = its argmax); a token ranked beyond
    the widest bucket (or outside the draft vocabulary, label < 0) gets the widest bucket.
    logits [..., V], labels [...] (draft ids) -> [...] long."""
    safe = labels.clamp_min(0)
    tgt = logits.gather(-1, safe[..., None])
    rank = (logits > tgt).sum(-1)  # ties count in the token's favour
    w = torch.tensor(widths, device=logits.device)
    bucket = (rank[..., None] >= w).sum(-1).clamp_max(len(widths) - 1)
    return bucket.masked_fill(labels < 0, len(widths) - 1)


Model = SpecBlock
