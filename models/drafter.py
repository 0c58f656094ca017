"""Pieces every block drafter shares: the conditioning cache, the draft layer, the draft vocabulary.

Shape names: B batch rows, T context positions (target features known), N blocks (anchors) per
row, P predicted tokens per block, H drafter width (= target width), F = n_feat * target width.

A block is anchored at context position t: target features are known for positions 0..t, the
token x[t+1] is known (the target's bonus/last sampled token) but its features are not, and the
block predicts tokens x[t+2] .. x[t+1+P]. Training packs N anchors of one row into one pass with
a mask; inference runs N = 1 against the cache.

Context keys/values: each draft layer projects the fused conditioning stream c (one row per
context position) with its own wk/wv (DFlash's "features injected as K/V"). They depend on c only,
so the `DraftCache` keeps them and a new block costs one pass over P positions plus the newly
accepted context rows.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .common import MLP, RMSNorm, apply_rope, attention, rope_cos_sin


@dataclass
class DraftCache:
    """Per-layer context K [B, Hkv, S, D] (rope applied) and V, and the conditioning rows c
    [B, S, H] themselves (SpecBlock broadcasts c[anchor]), for context positions 0..S-1."""

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    cond: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if not self.k else self.k[0].shape[2]

    def crop(self, n: int) -> None:
        """Keep context positions 0..n-1 (after a rollback of the target)."""
        self.k = [k[:, :, :n] for k in self.k]
        self.v = [v[:, :, :n] for v in self.v]
        if self.cond is not None:
            self.cond = self.cond[:, :n]


class DraftAttention(nn.Module):
    """Block queries attend to [context K/V ; block K/V]; NEOX rope on absolute positions."""

    def __init__(self, dim: int, n_head: int, n_kv_head: int, head_dim: int, rope_base: float,
                 qk_norm: bool = False, eps: float = 1e-6):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim, self.rope_base = n_head, n_kv_head, head_dim, rope_base
        # optional per-head RMSNorm of q and k before rope (Qwen3 / DFlash; upstream's dflash graph
        # always applies it, so a DBlast trained with it exports to upstream's layout exactly)
        self.q_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps) if qk_norm else None
        self.wq = nn.Linear(dim, n_head * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_head * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_head * head_dim, bias=False)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=False)

    def context_kv(self, ctx: torch.Tensor, start: int):
        """ctx [B, S, H] at positions start.. -> k, v [B, Hkv, S, D]."""
        B, S, _ = ctx.shape
        pos = torch.arange(start, start + S, device=ctx.device).expand(B, S)
        cos, sin = rope_cos_sin(pos, self.head_dim, self.rope_base)
        k = self._norm(self.k_norm, self.wk(ctx).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2))
        v = self.wv(ctx).view(B, S, self.n_kv_head, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin, neox=True), v

    @staticmethod
    def _norm(norm, x):
        return x if norm is None else norm(x)

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        """x [B, M, H] block rows at absolute positions pos [B, M]; ctx_k/v [B, Hkv, S, D];
        mask [B, 1, M, S + M] bool -> [B, M, H]."""
        B, M, _ = x.shape
        cos, sin = rope_cos_sin(pos, self.head_dim, self.rope_base)
        q = self._norm(self.q_norm, self.wq(x).view(B, M, self.n_head, self.head_dim).transpose(1, 2))
        k = self._norm(self.k_norm, self.wk(x).view(B, M, self.n_kv_head, self.head_dim).transpose(1, 2))
        q, k = apply_rope(q, cos, sin, True), apply_rope(k, cos, sin, True)
        v = self.wv(x).view(B, M, self.n_kv_head, self.head_dim).transpose(1, 2)
        k = torch.cat([ctx_k, k], dim=2)  # [B, Hkv, S + M, D]
        v = torch.cat([ctx_v, v], dim=2)
        return self.wo(attention(q, k, v, mask))


class DraftLayer(nn.Module):
    """Pre-norm transformer layer of the drafter (attention over context + block, SiLU MLP)."""

    def __init__(self, dim, n_head, n_kv_head, head_dim, ffn_dim, rope_base, eps, qk_norm=False):
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = DraftAttention(dim, n_head, n_kv_head, head_dim, rope_base, qk_norm, eps)
        self.ffn_norm = RMSNorm(dim, eps)
        self.ffn = MLP(dim, ffn_dim)

    def forward(self, x, pos, ctx_k, ctx_v, mask):
        x = x + self.attn(self.attn_norm(x), pos, ctx_k, ctx_v, mask)
        return x + self.ffn(self.ffn_norm(x))


def block_mask(anchors: torch.Tensor, n_ctx: int, P: int, causal: bool) -> torch.Tensor:
    """Visibility for N blocks of P rows packed in one pass: anchors [B, N] ->
    bool [B, 1, N*P, n_ctx + N*P]. Row (n, k) sees context s <= anchors[n] and, within its own
    block only, k' <= k (causal) or every k' (bidirectional)."""
    B, N = anchors.shape
    dev = anchors.device
    s = torch.arange(n_ctx, device=dev)
    ctx_vis = (s[None, None, :] <= anchors[:, :, None])  # [B, N, S]
    ctx_vis = ctx_vis[:, :, None, :].expand(B, N, P, n_ctx).reshape(B, N * P, n_ctx)
    k = torch.arange(P, device=dev)
    inner = (k[None, :] <= k[:, None]) if causal else torch.ones(P, P, dtype=torch.bool, device=dev)
    blk = torch.block_diag(*[inner] * N)  # [N*P, N*P]
    return torch.cat([ctx_vis, blk[None].expand(B, -1, -1)], dim=-1)[:, None]


def softmax_summary(logits: torch.Tensor, top_k: int = 4) -> torch.Tensor:
    """[..., V] -> [..., 2*top_k] summary of a softmax for the rank head: the top-k log-probs,
    the gaps between consecutive ones, and the entropy (top_k + (top_k-1) + 1 features)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    top = logp.topk(top_k, dim=-1).values
    gaps = top[..., :-1] - top[..., 1:]
    ent = -(logp.exp() * logp).sum(-1, keepdim=True)
    return torch.cat([top, gaps, ent], dim=-1)


class DraftVocab(nn.Module):
    """Drafter LM head. draft_vocab_size == 0: the target's head, shared and frozen (bound at run
    time, never saved). Otherwise a trainable head over a frequency-chosen sub-vocabulary with
    `d2t` [Vd] mapping draft ids to target ids (EAGLE-3's trick: the head is most of a small
    drafter's cost, and the frequent few thousand tokens cover most of the text)."""

    def __init__(self, dim: int, vocab_size: int, draft_vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.draft_vocab_size = draft_vocab_size
        if draft_vocab_size:
            self.lm_head = nn.Linear(dim, draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.arange(draft_vocab_size, dtype=torch.long))
        else:
            self.lm_head = None
            self.register_buffer("d2t", None)

    def set_vocab(self, d2t: torch.Tensor, head_weight: torch.Tensor | None = None) -> None:
        """Install the draft->target map; initialise the head from the target's rows."""
        assert self.lm_head is not None and d2t.numel() == self.draft_vocab_size
        self.d2t = d2t.to(torch.long).clone()
        if head_weight is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(head_weight[self.d2t].to(self.lm_head.weight.dtype))

    def resize(self, draft_vocab_size: int) -> None:
        """A fresh head of `draft_vocab_size` rows (identity map): the shape a checkpoint of that size
        loads into."""
        w = self.lm_head.weight
        self.draft_vocab_size = int(draft_vocab_size)
        self.lm_head = nn.Linear(w.shape[1], self.draft_vocab_size, bias=False).to(w)
        self.d2t = torch.arange(self.draft_vocab_size, dtype=torch.long, device=w.device)

    @torch.no_grad()
    def remap(self, d2t: torch.Tensor, fill: torch.Tensor) -> int:
        """Make `d2t` (any size) the draft vocabulary: a token already in it keeps its trained head row,
        a new one at draft id i takes fill[i] ([len(d2t), H]). Returns how many tokens were kept."""
        rows = dict(zip(self.d2t.tolist(), self.lm_head.weight.detach().clone()))
        fill = fill.detach().to(self.lm_head.weight.dtype)
        if d2t.numel() != self.draft_vocab_size:
            self.resize(d2t.numel())
        self.d2t = d2t.to(torch.long).clone()
        for i, tok in enumerate(self.d2t.tolist()):
            self.lm_head.weight[i] = rows[tok] if tok in rows else fill[i]
        return len(rows.keys() & set(self.d2t.tolist()))

    def repick(self, d2t: torch.Tensor, head_weight: torch.Tensor) -> int:
        """Re-pick the draft vocabulary as `d2t` (`remap`): a new token starts at the trained rows' mean
        plus half the target's row (the target's row alone is not in the trained head's scale: on the
        stage-4 SpecBlock it took the held-out estimate from 0.81 to 0.34, this start leaves it at 0.81)."""
        start = self.lm_head.weight.detach().mean(0)
        return self.remap(d2t, start + 0.5 * head_weight[d2t.to(torch.long)].to(start.dtype))

    def t2d(self, tokens: torch.Tensor) -> torch.Tensor:
        """Target ids -> draft ids (-1 where the token is outside the draft vocabulary)."""
        if self.lm_head is None:
            return tokens
        table = torch.full((self.vocab_size,), -1, dtype=torch.long, device=tokens.device)
        table[self.d2t] = torch.arange(self.draft_vocab_size, device=tokens.device)
        return table[tokens.clamp_min(0)].masked_fill(tokens < 0, -1)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.lm_head is None else self.d2t[draft_ids]

    def forward(self, h: torch.Tensor, target_head: torch.Tensor | None) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(h)
        if target_head is None:
            raise RuntimeError("drafter shares the target's LM head: call bind_target() first")
        return h @ target_head.T


class BlockDrafter(nn.Module):
    """Common frame of SpecBlock and DBlast: conditioning fusion, context cache, target binding.

    Subclasses define `block_inputs`, `causal`, and their own heads."""

    causal: bool = False

    def __init__(self, args):
        super().__init__()
        self.args = args
        H = args.dim
        # fuse the concatenated target layer states into the conditioning stream c [.., H]
        self.fc = nn.Linear(len(args.target_layers) * args.target_dim, H, bias=False)
        # per-dimension input scale of the features (1/RMS over training data, see `fit_feature_scale`):
        # small targets carry "massive activations" (SmolLM2-135M: one dimension at RMS ~2400 against a
        # median of ~7), which would otherwise dominate fc's output and, after cond_norm, drown the
        # rest. Linear, so `export_state` folds it into fc and drafter GGUFs never carry it.
        self.register_buffer("feat_scale", torch.ones(len(args.target_layers) * args.target_dim))
        self.cond_norm = RMSNorm(H, args.norm_eps)
        self.layers = nn.ModuleList(
            DraftLayer(H, args.n_head, args.n_kv_head, args.head_dim, args.ffn_dim, args.rope_base, args.norm_eps,
                       getattr(args, "qk_norm", False))
            for _ in range(args.n_layer))
        self.norm = RMSNorm(H, args.norm_eps)
        self.vocab = DraftVocab(H, args.vocab_size, args.draft_vocab_size)
        # the target's frozen embeddings / head: non-persistent, so checkpoints never carry them
        self.register_buffer("target_embed", None, persistent=False)
        self.register_buffer("target_head", None, persistent=False)

    def resize_block(self, block_size: int) -> None:
        """Draft `block_size` (the method's block size) from now on. The shared weights carry over;
        a method with per-position weights extends or truncates them (SpecBlock)."""
        self.args.block_size = int(block_size)

    def grow_layers(self, n_layer: int) -> None:
        """Append layers up to `n_layer`, each a copy of the last trained one whose residual
        outputs (attention output and FFN down projections) start at zero: the grown drafter
        drafts exactly what it did, and training opens the new layers from trained features."""
        if n_layer < len(self.layers):
            raise ValueError(f"n_layer {n_layer}: the drafter already has {len(self.layers)} layers")
        while len(self.layers) < n_layer:
            layer = copy.deepcopy(self.layers[-1])
            with torch.no_grad():
                layer.attn.wo.weight.zero_()
                layer.ffn.down_proj.weight.zero_()
            self.layers.append(layer)
        self.args.n_layer = int(n_layer)

    @torch.no_grad()
    def grow_ffn(self, ffn_dim: int, like: "BlockDrafter | None" = None) -> None:
        """Widen every layer's FFN to `ffn_dim` hidden units: the new gate/up rows drawn at the scale of
        the trained ones (or `like`'s rows, a drafter widened from this one), the new down-projection
        columns zero, so the widened drafter drafts exactly what it did."""
        if ffn_dim < self.args.ffn_dim:
            raise ValueError(f"ffn_dim {ffn_dim}: the drafter's FFN already has {self.args.ffn_dim} units")
        old = self.args.ffn_dim
        for i, layer in enumerate(self.layers):
            f = layer.ffn
            grown = MLP(f.gate_proj.in_features, ffn_dim).to(f.gate_proj.weight.device)
            for name in ("gate_proj", "up_proj"):
                w, g = getattr(f, name).weight, getattr(grown, name).weight
                g[:old] = w
                g[old:] = (getattr(like.layers[i].ffn, name).weight[old:ffn_dim] if like is not None
                           else torch.randn_like(g[old:]) * w.std())
            grown.down_proj.weight.zero_()
            grown.down_proj.weight[:, :old] = f.down_proj.weight
            layer.ffn = grown
        self.args.ffn_dim = int(ffn_dim)

    @torch.no_grad()
    def grow_target_layers(self, target_layers: list[int]) -> list[int]:
        """Read the taps `target_layers` (a superset of the drafter's, in the order given) from now on.
        fc's columns for the new layers start at zero (the drafter drafts exactly what it did) and
        their feature scale at one; returns the new layers (the caller fits their scale on data, as
        `fit_feature_scale` does for a new drafter: `set_layer_scale`)."""
        old, new = [int(x) for x in self.args.target_layers], [int(x) for x in target_layers]
        if len(set(new)) != len(new) or not set(old) <= set(new):
            raise ValueError(f"target layers {new}: expected every one of the drafter's {old}, each once")
        D = self.args.target_dim
        w = self.fc.weight.new_zeros(self.fc.weight.shape[0], len(new) * D)
        scale = self.feat_scale.new_ones(len(new) * D)
        for i, lid in enumerate(new):
            if lid in old:
                j = old.index(lid)
                w[:, i * D:(i + 1) * D] = self.fc.weight[:, j * D:(j + 1) * D]
                scale[i * D:(i + 1) * D] = self.feat_scale[j * D:(j + 1) * D]
        self.fc = nn.Linear(len(new) * D, w.shape[0], bias=False).to(w.device)
        self.fc.weight.copy_(w)
        self.feat_scale = scale
        self.args.target_layers = new
        return [lid for lid in new if lid not in old]

    @torch.no_grad()
    def set_layer_scale(self, lid: int, scale: torch.Tensor) -> None:
        """The feature scale of target layer `lid`'s dimensions (fc's input order)."""
        i, D = [int(x) for x in self.args.target_layers].index(int(lid)), self.args.target_dim
        self.feat_scale[i * D:(i + 1) * D] = scale.to(self.feat_scale.dtype)

    def layer_scale(self, lid: int) -> torch.Tensor:
        i, D = [int(x) for x in self.args.target_layers].index(int(lid)), self.args.target_dim
        return self.feat_scale[i * D:(i + 1) * D]

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints from before the feature scale, and exported states (scale folded into fc)
        state_dict.setdefault(prefix + "feat_scale", torch.ones_like(self.feat_scale))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @torch.no_grad()
    def fit_feature_scale(self, feats: torch.Tensor) -> None:
        """Set the feature scale from sample rows [..., F] of target features: each dimension
        divided by its RMS over the rows."""
        x = feats.reshape(-1, feats.shape[-1]).float()
        self.feat_scale.copy_(x.pow(2).mean(0).sqrt().clamp_min(1e-6).reciprocal())

    def export_state(self) -> dict:
        """state_dict with the feature scale folded into fc (what converters write)."""
        state = dict(self.state_dict())
        scale = state.pop("feat_scale")
        state["fc.weight"] = state["fc.weight"] * scale.to(state["fc.weight"].dtype)
        return state

    def bind_target(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> "BlockDrafter":
        self.target_embed = embed_weight.detach()
        self.target_head = head_weight.detach()
        return self

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.target_embed is None:
            raise RuntimeError("drafter uses the target's embeddings: call bind_target() first")
        return F.embedding(tokens, self.target_embed).to(self.fc.weight.dtype)

    def condition(self, feats: torch.Tensor) -> torch.Tensor:
        """[B, S, F] concatenated target layer states -> conditioning c [B, S, H]."""
        return self.cond_norm(self.fc(feats.to(self.fc.weight.dtype) * self.feat_scale.to(self.fc.weight.dtype)))

    def context(self, cond: torch.Tensor, cache: DraftCache | None):
        """Per-layer context K/V for all positions (cache + new `cond` rows) and all c rows."""
        start = 0 if cache is None else cache.length
        all_cond = cond
        if cache is not None and cache.cond is not None:
            all_cond = torch.cat([cache.cond, cond], dim=1)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            k, v = layer.attn.context_kv(cond, start)
            if cache is not None and cache.k:
                k = torch.cat([cache.k[i], k], dim=2)
                v = torch.cat([cache.v[i], v], dim=2)
            ks.append(k)
            vs.append(v)
        if cache is not None:
            cache.k, cache.v, cache.cond = ks, vs, all_cond
        return ks, vs, all_cond

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.vocab(h, self.target_head)

    def new_cache(self) -> DraftCache:
        return DraftCache()
