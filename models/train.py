"""Training loop for the block drafters, readable top to bottom: config -> data -> get_batch ->
loss -> step -> estimate_acceptance -> checkpoint.

Data come from a feature source (models/data.py): the feature cache (`--features cache --data
DIR`), or the torch target run on each batch's sequences as it is drawn (`--features on-the-fly`,
no cache; the same ShareGPT/chitchat text the cache builder reads). Both fill the same batch in
`Batches.get_batch`. One batch = `batch_size` sequences x `anchors_per_seq` blocks, all blocks of a
row packed in one drafter pass (drafter.block_mask). Labels are the TARGET's greedy tokens
(`greedy`), not the text's tokens: the drafter must predict what the target would say, which is
what verification accepts.

Cross-block training (SpecBlock, `cross_block_weight` > 0; off by default). For every block
anchored at t, a second block is anchored at t + m (m = `cross_block_shift`, 0 = the block size:
blocks chained end to end) and fed:
  conditioning  block 1's final-normed state at slot m-1 (the state that drafted x[t+m+1]), with
                its gradient, instead of the target's c[t+m] (those features do not exist yet
                when a drafter chains blocks without a target pass);
  last token    the text's x[t+m+1] (teacher forcing, as block 1's x[t+1]);
  context       the target's features up to t only (drafter ctx_end), the same block 1 saw;
  positions     t+m+1 .. t+m+K (rope), labels the target's greedy tokens x[t+m+2 ..].
Its loss (losses.cross_block_cross_entropy: CE with its own valid-prefix mask, plus the rank
head's CE and the distillation term when on) is added with weight `cross_block_weight`.

Checkpoint (out dir): `drafter.safetensors` (drafter weights only; the target's embeddings/head
are never saved), `drafter.json` {model_args, config, step, history} (enough to rebuild the model
with models.build_model), `optimizer.pt` (for resume).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def _opt(default, help: str, methods: tuple[str, ...] = ("specblock", "dblast")):
    """A TrainConfig field with its CLI help and the methods whose `blockspec train` command
    offers it (models/cli.py builds the options from this metadata)."""
    meta = dict(help=help, methods=methods)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


SPECBLOCK = ("specblock",)
DBLAST = ("dblast",)


@dataclass
class TrainConfig:
    method: str = _opt("specblock", "specblock | dblast (the command's name)")
    target: str = _opt("", "GGUF of the target")
    out: str = _opt("", "checkpoint directory")
    data: str = _opt("", "feature cache directory (features = cache)")
    features: str = _opt("cache", "cache: read --data; on-the-fly: torch target per batch, no cache")
    sources: str = _opt("sharegpt,chitchat", "on-the-fly: comma-separated text sources")
    n_seqs: int = _opt(2048, "on-the-fly: training sequences (the cache builder's default)")
    max_len: int = _opt(384, "on-the-fly: tokens per sequence window")
    n_layer: int = _opt(0, "drafter layers (0: 2, or with --init its own; a larger --n-layer grows it: new "
                           "layers start as copies of its last with their outputs zeroed)")
    ffn_dim: int = _opt(0, "drafter FFN width (0: the target's, or the --init drafter's; with --init a larger one "
                           "widens it: the new units' outputs start at zero)")
    block_size: int = _opt(0, "tokens per block (0: the method's default, specblock K=4, dblast B=5)")
    draft_vocab_size: int = _opt(8192, "draft vocabulary size (0: share the target's head)")
    target_layers: list = _opt([], "comma-separated target layer-input ids the drafter reads "
                                   "(empty: the method's default, or the --init drafter's; with --init, more "
                                   "layers than its own grow its input: the new ones start at zero weight)")
    n_categories: int = _opt(1, "categories Kz of the latent (1: plain DFlash)", DBLAST)
    qk_norm: bool = _opt(False, "per-head q/k RMSNorm (DFlash's; exports to upstream dflash exactly)", DBLAST)
    loss: str = _opt("nll", "nll | al (acceptance-length surrogate)", DBLAST)
    nll_weight: float = _opt(0.1, "--loss al: NLL kept beside the AL surrogate (stabilises the start)", DBLAST)
    tau: float = _opt(1e-3, "--loss al: truncation threshold of the surrogate", DBLAST)
    temperature: float = _opt(1.0, "target temperature of p_T (SpecBlock distillation, DBlast --loss al)")
    decay_gamma: float = _opt(0.0, "DFlash's position decay of the block CE (0: off)", SPECBLOCK)
    prefix_mask: bool = _opt(True, "no loss on positions after the first wrong greedy draft", SPECBLOCK)
    rank_weight: float = _opt(0.1, "weight of the rank head's loss", SPECBLOCK)
    distill_weight: float = _opt(0.0, "weight of the KL to the target's top-k distribution (0: off)", SPECBLOCK)
    cross_block_weight: float = _opt(0.0, "weight of the cross-block term (0: off, the plain recipe)", SPECBLOCK)
    cross_block_shift: int = _opt(0, "block 2's anchor offset m in 1..K (0: K, chained blocks)", SPECBLOCK)
    no_target_features: bool = _opt(False, "baseline: zero the target features")
    feature_scale: bool = _opt(True, "scale each feature dim by 1/RMS on training rows (folded into fc)")
    steps: int = _opt(1000, "optimizer steps in all (a resumed run continues to this)")
    batch_size: int = _opt(8, "sequences per batch")
    anchors_per_seq: int = _opt(16, "blocks drawn per sequence per batch")
    lr: float = _opt(1e-3, "peak learning rate (after warmup, cosine decay to --min-lr)")
    min_lr: float = _opt(1e-4, "learning rate at the last step")
    warmup: int = _opt(50, "linear warmup steps")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    grad_clip: float = _opt(1.0, "gradient norm clip (0: off)")
    eval_every: int = _opt(200, "steps between held-out estimates")
    eval_batches: int = _opt(8, "held-out batches per estimate")
    heldout_frac: float = _opt(0.1, "share of the data held out for the estimate")
    save_every: int = _opt(200, "steps between checkpoints")
    log_every: int = _opt(20, "steps between log lines")
    seed: int = _opt(0, "seed of the split, the batches and the init")
    threads: int = _opt(0, "torch threads (0: torch's default)")
    device: str = _opt("auto", "torch device of the drafter: auto (cuda when this torch has one, else cpu), "
                               "cpu, cuda, cuda:N; the feature cache stays in host memory")
    precision: str = _opt("fp32", "fp32 | bf16: the training step's matmuls in bf16 autocast (weights, optimizer, "
                                  "losses and the held-out estimate stay fp32); on this CPU (avx512_bf16) 1.4-1.6x "
                                  "the steps per second")
    serve_anchors: bool = _opt(False, "draw the training blocks' anchors where greedy serving drafts (the start "
                                      "drafter's walk over the training answers, computed once and saved in "
                                      "--out as serve_anchors.npz), not uniformly over the answers")
    resume: bool = _opt(True, "continue from the checkpoint in --out if there is one")
    init: str = _opt("", "fine-tune: start from this drafter (checkpoint dir or GGUF), its shape, draft "
                         "vocabulary and weights (the size options are then ignored, but --block-size "
                         "resizes its block: SpecBlock's new position queries start as its last one; "
                         "--n-layer grows its layers, --ffn-dim its FFN width, --target-layers its taps)")
    repick_vocab: bool = _opt(False, "with --init: re-pick the draft vocabulary (same size) from this data's "
                                     "answers; kept tokens keep their trained head rows, new ones start at the "
                                     "trained rows' mean plus half the target's row")
    repick_size: int = _opt(0, "with --repick-vocab: the re-picked vocabulary's size (0: the --init drafter's "
                               "own; a larger one grows the head)")

FEATURE_SOURCES = ("cache", "on-the-fly")
PRECISIONS = ("fp32", "bf16")
DEFAULT_BLOCK = {"specblock": 4, "dblast": 5}  # K / B when --block-size is 0


def check_config(c: TrainConfig) -> None:
    """One clear line for an option combination that cannot work (before anything loads)."""
    from blockspec.runtime.errors import BlockspecError

    if c.method not in DEFAULT_BLOCK:
        raise BlockspecError(f"unknown drafter method {c.method!r} (known: {', '.join(DEFAULT_BLOCK)})")
    block_size = c.block_size or DEFAULT_BLOCK[c.method]
    least = 2 if c.method == "dblast" else 1  # DBlast's block holds the last token, then the drafted ones
    if c.block_size < 0 or block_size < least:
        raise BlockspecError(f"--block-size {c.block_size}: expected at least {least} (0: the method's default)")
    if c.n_layer < 0:
        raise BlockspecError(f"--n-layer {c.n_layer}: expected at least 1 (0: 2, or the --init drafter's)")
    if c.precision not in PRECISIONS:
        raise BlockspecError(f"--precision {c.precision!r}: expected one of {', '.join(PRECISIONS)}")
    if c.features not in FEATURE_SOURCES:
        raise BlockspecError(f"--features {c.features!r}: expected one of {', '.join(FEATURE_SOURCES)}")
    if c.features == "cache" and not c.data:
        raise BlockspecError("--features cache needs --data DIR (a cache from `blockspec train features`)")
    if c.repick_vocab and not c.init:
        raise BlockspecError("--repick-vocab re-picks an --init drafter's vocabulary (a new drafter picks its own)")
    if c.repick_size and not c.repick_vocab:
        raise BlockspecError("--repick-size: the size of a --repick-vocab re-pick; add --repick-vocab")
    if c.repick_size < 0:
        raise BlockspecError(f"--repick-size {c.repick_size}: expected at least 1 (0: the --init drafter's own)")
    if c.qk_norm and c.method != "dblast":
        raise BlockspecError(f"--qk-norm: a DBlast option (upstream dflash's attention), not {c.method}'s")
    if c.cross_block_weight:
        if c.method != "specblock":
            raise BlockspecError(f"--cross-block-weight: cross-block training is SpecBlock's, not {c.method}'s")
        if not 0 <= c.cross_block_shift <= block_size:
            raise BlockspecError(f"--cross-block-shift {c.cross_block_shift}: expected 0..{block_size} "
                                 f"(0 = the block size)")


def cross_block_shift(c: TrainConfig, block_size: int) -> int:
    """The anchor offset m of the cross-block term (0 when the term is off)."""
    return (c.cross_block_shift or block_size) if c.cross_block_weight else 0


def get_lr(step: int, c: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    t = min(1.0, (step - c.warmup) / max(1, c.steps - c.warmup))
    return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1 + math.cos(math.pi * t))


def method_defaults(method: str, n_layer_target: int) -> dict:
    from .common import default_layers

    if method == "specblock":
        return dict(block_size=DEFAULT_BLOCK[method], target_layers=default_layers(n_layer_target, 3))
    if method == "dblast":
        return dict(block_size=DEFAULT_BLOCK[method], target_layers=default_layers(n_layer_target, 5))
    raise ValueError(f"unknown drafter method {method!r} (known: specblock, dblast)")


def make_model_args(c: TrainConfig, target_args) -> dict:
    d = method_defaults(c.method, target_args.n_layer)
    return dict(
        model_type=c.method, dim=target_args.dim, n_layer=c.n_layer or 2, n_head=target_args.n_head,
        n_kv_head=target_args.n_kv_head, head_dim=target_args.head_dim, ffn_dim=c.ffn_dim or target_args.ffn_dim,
        vocab_size=target_args.vocab_size, draft_vocab_size=c.draft_vocab_size,
        target_layers=list(c.target_layers or d["target_layers"]), target_dim=target_args.dim,
        block_size=c.block_size or d["block_size"], n_categories=c.n_categories, qk_norm=c.qk_norm,
        norm_eps=target_args.norm_eps,
    )


SPAN_KEYS = ("labels", "data_next", "valid", "top_ids", "top_logp")  # [B, N, span, ...]


class Batches:
    """Random blocks from a feature source (data.CachedFeatures or data.OnlineFeatures); the last
    `heldout_frac` of sequences is held out."""

    def __init__(self, source, n_predict: int, heldout_frac: float, seed: int):
        self.src = source
        self.P = n_predict
        n = len(source.lengths)
        n_held = max(1, int(round(n * heldout_frac))) if n > 1 else 0
        self.split = {"train": np.arange(0, n - n_held), "heldout": np.arange(n - n_held, n)}
        pidx = getattr(source, "prompt_idx", None)
        if pidx is not None and n_held:
            # every round(1/heldout_frac)-th prompt: the same prompts however far the cache has grown
            # the estimate predicts greedy serving: held-out prompts with sampled answers are unused
            held = pidx % max(1, int(round(1 / heldout_frac))) == 0
            greedy = ~np.asarray(getattr(source, "sampled", np.zeros(n, bool)))
            self.split = {"train": np.flatnonzero(~held), "heldout": np.flatnonzero(held & greedy)}
            if not len(self.split["train"]):
                self.split["train"] = self.split["heldout"]
        if len(self.split["train"]) == 0:
            self.split["train"] = self.split["heldout"]
        self.rng = np.random.default_rng(seed)
        # a self-distilled source marks its answers: blocks are anchored there only (the first at
        # the last prompt token, as after a prefill), rows drawn in proportion to their anchors so
        # every answer token weighs the same
        start = getattr(source, "answer_start", None)
        self.lo = np.zeros(n, np.int64) if start is None else np.maximum(np.asarray(start) - 1, 0)
        self.weighted = start is not None
        self.row_p = {k: self._row_p(ids) for k, ids in self.split.items()}
        # train --serve-anchors: {row: anchors} the train split's blocks are drawn from (serve_anchors)
        self.train_anchors: dict[int, np.ndarray] | None = None

    def require_heldout(self, data: str) -> None:
        """BlockspecError, one line, when there is nothing to estimate on: the held-out prompts of a
        self-distilled cache count only where their answer is greedy."""
        from blockspec.runtime.errors import BlockspecError

        if not len(self.split["heldout"]):
            raise BlockspecError(f"--data {data}: no held-out greedy answers to estimate on (every held-out "
                                 "answer is sampled: `train data --sample-frac 1`); add a cache with greedy "
                                 "answers (--data A,B)")

    def _row_p(self, ids: np.ndarray):
        if not self.weighted or not len(ids):
            return None
        w = np.maximum(self.src.lengths[ids] - 1 - self.lo[ids], 0).astype(np.float64)
        return w / w.sum() if w.sum() else None

    def restrict(self, split: str, ids: np.ndarray) -> None:
        """Draw `split`'s rows from `ids` alone (weighted per answer token, as built)."""
        self.split[split] = np.asarray(ids)
        self.row_p[split] = self._row_p(self.split[split])

    def get_batch(self, split: str, batch_size: int, anchors: int, rng: np.random.Generator | None = None,
                  span: int | None = None, tokens: bool = False):
        """-> dict of torch tensors: feats [B, S, F], anchors [B, N], last [B, N], labels /
        data_next / valid [B, N, span], top_ids / top_logp [B, N, span, k]. `span` (default: the
        block's P) label positions from anchor+1 on; a longer span carries the cross-block
        block's labels too, and never changes which rows and anchors are drawn. `tokens`: also
        the rows' whole token sequences, "tokens" [B, S] (numpy; the diagnostic scripts read them)."""
        rng = rng or self.rng
        rows = rng.choice(self.split[split], size=batch_size, p=self.row_p[split])
        lengths = self.src.lengths[rows]
        # anchor t needs x[t+1] and at least one label greedy[t+1]; positions past the end are invalid
        hi = np.maximum(lengths - 2, 0)
        lo = np.minimum(self.lo[rows], hi)
        sets = self.train_anchors if split == "train" else None
        anc = np.stack([rng.choice(sets[r], size=anchors) if sets is not None and len(sets.get(r, ())) else
                        rng.integers(l, h + 1, size=anchors) for r, l, h in zip(rows.tolist(), lo, hi)])  # [B, N]
        return self.batch_at(rows, anc, span, tokens)

    def batch_at(self, rows: np.ndarray, anc: np.ndarray, span: int | None = None, tokens: bool = False):
        """get_batch's dict for given rows [B] and anchors [B, N]."""
        import torch

        P = span or self.P
        lengths = self.src.lengths[rows]
        d = self.src.rows(rows)  # [B, S, ...], S = lengths.max()
        S = int(lengths.max())
        j = np.arange(P)
        pos = anc[..., None] + 1 + j  # [B, N, P] index of the target position predicting each label
        valid = pos < lengths[:, None, None] - 1
        pos_c = np.minimum(pos, S - 1)
        r = np.arange(len(rows))[:, None, None]
        out = dict(
            feats=torch.from_numpy(d["feats"].astype(np.float32)),
            anchors=torch.from_numpy(anc).long(),
            last=torch.from_numpy(d["tokens"][r[..., 0], anc + 1]).long(),
            labels=torch.from_numpy(d["greedy"][r, pos_c]).long(),
            data_next=torch.from_numpy(d["tokens"][r, np.minimum(pos_c + 1, S - 1)]).long(),
            valid=torch.from_numpy(valid),
            top_ids=torch.from_numpy(d["top_ids"][r, pos_c]).long(),
            top_logp=torch.from_numpy(d["top_logp"][r, pos_c].astype(np.float32)),
        )
        if tokens:
            out["tokens"] = d["tokens"]
        return out


def to_device(b: dict, device) -> dict:
    """The batch's tensors on `device` (numpy entries, such as "tokens", stay on the host)."""
    import torch

    return {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}


def model_device(model):
    return next(model.parameters()).device


def block_view(b: dict, start: int, P: int) -> dict:
    """The batch as seen by the block whose labels are span positions start .. start+P-1."""
    return {k: (v[:, :, start:start + P] if k in SPAN_KEYS else v) for k, v in b.items()}


def accepted_lengths(draft: "torch.Tensor", labels, data_next, valid):  # noqa: F821
    """Offline acceptance of greedy blocks, per block [..]: the number of leading positions whose
    drafted token equals the target's greedy token, counted while it is evaluable. Labels come from
    the target run on the TEXT, so the comparison at position j+1 assumes the text's token j equals
    the target's greedy token j; where it does not, counting stops after position j (a teacher-forced
    lower bound of the accepted prefix in greedy speculative decoding)."""
    import torch

    match = (draft == labels) & valid
    cont = match & (data_next == labels)  # position j matched and the text stayed on the greedy path
    reach = torch.cumprod(torch.nn.functional.pad(cont.long(), (1, 0), value=1)[..., :-1], dim=-1).bool()
    return (match & reach).sum(-1)


def draft_greedy(model, b):
    """Greedy block (target ids) [B, N, P]; DBlast uses its most likely category."""
    out = model(b["feats"], b["anchors"], b["last"])
    if model.args.model_type == "dblast":
        z = out.prior_logits.argmax(-1)  # [B, N]
        logits = out.logits.gather(2, z[:, :, None, None, None].expand(-1, -1, 1, *out.logits.shape[3:]))[:, :, 0]
    else:
        logits = out.logits
    return model.vocab.to_target(logits.argmax(-1)), out


def cross_block_forward(model, b, out, m: int):
    """SpecBlock's second block, anchored m after the first (see the module docstring): b is
    the full-span batch, out the first block's output. -> SpecBlockOutput of block 2."""
    return model(b["feats"], b["anchors"] + m, b["data_next"][:, :, m - 1],
                 cond_override=out.hidden[:, :, m - 1], ctx_end=b["anchors"])


def estimate_acceptance(model, batches: Batches, c: TrainConfig, n_batches: int | None = None) -> dict:
    """Offline acceptance estimate on the held-out split: mean over blocks of `accepted_lengths`
    (expected accepted prefix of a greedy block against the target's greedy tokens), with a fixed
    seed so successive estimates see the same blocks. Also the per-position match rate, and with
    cross-block training the same two figures for the chained block (`xb_`)."""
    import torch

    P = model.args.n_predict
    m = cross_block_shift(c, P)
    rng = np.random.default_rng(12345)
    acc, match, n = 0.0, None, 0
    hist = torch.zeros(P + 1, dtype=torch.long)  # blocks by accepted prefix length 0..P
    xacc, xmatch, xn = 0.0, torch.zeros(P), 0
    dev = model_device(model)
    was = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(n_batches or c.eval_batches):
            bs = to_device(batches.get_batch("heldout", c.batch_size, c.anchors_per_seq, rng, span=m + P), dev)
            if c.no_target_features:
                bs["feats"].zero_()
            b = block_view(bs, 0, P)
            draft, out = draft_greedy(model, b)
            a = accepted_lengths(draft, b["labels"], b["data_next"], b["valid"])
            ok = b["valid"][..., 0]
            acc += float(a[ok].sum())
            hist += torch.bincount(a[ok].reshape(-1), minlength=P + 1).cpu()
            mt = ((draft == b["labels"]) & b["valid"]).float().sum((0, 1)).cpu()
            match = mt if match is None else match + mt
            n += int(ok.sum())
            if m:
                b2 = block_view(bs, m, P)
                draft2 = model.vocab.to_target(cross_block_forward(model, bs, out, m).logits.argmax(-1))
                ok2 = b2["valid"][..., 0]
                xacc += float(accepted_lengths(draft2, b2["labels"], b2["data_next"], b2["valid"])[ok2].sum())
                xmatch += ((draft2 == b2["labels"]) & b2["valid"]).float().sum((0, 1)).cpu()
                xn += int(ok2.sum())
    model.train(was)
    res = dict(accept=acc / max(1, n), blocks=n, match_per_pos=(match / max(1, n)).tolist(),
               accept_hist=hist.tolist())
    if m:
        res.update(xb_accept=xacc / max(1, xn), xb_blocks=xn, xb_match_per_pos=(xmatch / max(1, xn)).tolist())
    return res


def walk_row(model, batches: Batches, r: int, chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Greedy serving replayed offline on row r's answer (see walk_acceptance): the anchors its passes
    draft at, in order, and the accepted prefix k of each; empty where the row has no answer token to
    draft for. Every anchor of the row is drafted in one batch per `chunk`; the model is in eval mode
    and under no_grad (the caller's)."""
    n = int(batches.src.lengths[r])
    lo, last = int(batches.lo[r]), n - 3  # the last anchor with a label: t + 1 < n - 1
    if last < lo:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    dev = model_device(model)
    acc = []
    for a in range(lo, last + 1, chunk):
        anc = np.arange(a, min(a + chunk, last + 1))[None]
        b = to_device(batches.batch_at(np.array([r]), anc), dev)
        draft, _ = draft_greedy(model, b)
        acc.append(accepted_lengths(draft, b["labels"], b["data_next"], b["valid"])[0].cpu().numpy())
    acc = np.concatenate(acc)
    path, ks = [], []
    t = lo
    while t <= last:
        k = int(acc[t - lo])
        path.append(t)
        ks.append(k)
        t += k + 1
    return np.asarray(path, np.int64), np.asarray(ks, np.int64)


def walk_acceptance(model, batches: Batches, rows: np.ndarray, chunk: int = 256) -> dict:
    """Greedy serving replayed offline on the cache's greedy answers: from each answer's start (the
    prefill's pass, which drafts nothing), a greedy block is drafted at the current anchor, its
    accepted prefix k taken as a verify pass would, and the next anchor is k + 1 further on. Unlike
    `estimate_acceptance` (blocks at anchors drawn uniformly over the answers, so a stretch the chain
    crosses in one pass weighs as much as one it crosses in five), this counts the passes serving
    makes: tau = answer tokens / passes, as `blockspec bench` reports it, and accept_hist over passes
    (prefill in bin 0), as the bench's (`walk_row` per row)."""
    import torch

    hist = np.zeros(model.args.n_predict + 1, np.int64)
    tokens = 0
    was = model.training
    model.eval()
    with torch.no_grad():
        for r in np.asarray(rows).tolist():
            n, lo = int(batches.src.lengths[r]), int(batches.lo[r])
            if n - 1 - lo <= 0:
                continue  # no answer token
            hist[0] += 1  # the prefill's pass: the first answer token
            tokens += n - 1 - lo
            hist += np.bincount(walk_row(model, batches, r, chunk)[1], minlength=len(hist))
    model.train(was)
    return _walk_figures(hist, tokens)


def serve_anchors(model, batches: Batches, rows: np.ndarray, path: Path, progress: bool = True) -> dict:
    """{row: anchors greedy serving drafts at} for `rows` (`walk_row` with `model`), saved to `path`
    (npz, written atomically) and loaded from it when it is there: `train --serve-anchors` draws its
    training anchors from them."""
    import torch
    from tqdm import tqdm

    rows = np.asarray(rows, np.int64)
    if path.exists():
        z = np.load(path)
        off = z["offsets"]
        return {int(r): z["anchors"][off[i]:off[i + 1]] for i, r in enumerate(z["rows"])}
    was = model.training
    model.eval()
    paths = []
    with torch.no_grad():
        for r in tqdm(rows.tolist(), desc="serving walk over the training answers", disable=not progress):
            paths.append(walk_row(model, batches, r)[0])
    model.train(was)
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in paths])]).astype(np.int64)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, rows=rows, offsets=offsets, anchors=np.concatenate(paths) if paths else np.zeros(0, np.int64))
    os.replace(tmp, path)
    return dict(zip(rows.tolist(), paths))


def _walk_figures(hist: np.ndarray, tokens: int) -> dict:
    """walk_acceptance's summary of a pass histogram and the answer tokens it produced (walks over
    disjoint rows add: sum their histograms and tokens)."""
    passes = int(hist.sum())
    return dict(tau=round(tokens / max(1, passes), 4), passes=passes, tokens=int(tokens),
                accepting=round(1 - hist[0] / max(1, passes), 4), accept_hist=hist.tolist())


def specblock_terms(model, out, b, c: TrainConfig, shift: int = 0) -> dict:
    """Unweighted loss terms {ce, rank[, kd]} of one SpecBlock block. b: the full-span batch;
    shift 0: block 1 (labels [:P]), shift m: the cross-block block anchored m later (labels
    [m:m+P], losses.cross_block_cross_entropy)."""
    from . import losses
    from .specblock import rank_bucket_labels

    P = model.args.n_predict
    labels_d = model.vocab.t2d(b["labels"])  # draft ids, -1 outside the draft vocabulary
    gamma = c.decay_gamma or None
    if shift:
        ce, keep = losses.cross_block_cross_entropy(out.logits, labels_d, b["valid"], shift, c.prefix_mask, gamma)
    else:
        ce, keep = losses.block_cross_entropy(out.logits, labels_d[:, :, :P], b["valid"][:, :, :P], c.prefix_mask,
                                              gamma)
    lab = labels_d[:, :, shift:shift + P]
    buckets = rank_bucket_labels(out.logits.detach(), lab, model.args.rank_widths)
    terms = dict(ce=ce, rank=losses.rank_bucket_cross_entropy(out.rank_logits, buckets, keep))
    if c.distill_weight:
        v = block_view(b, shift, P)
        terms["kd"] = losses.distill_kl(out.logits, model.vocab.t2d(v["top_ids"]), v["top_logp"], keep,
                                        c.temperature)
    return terms


def loss_terms(model, b, c: TrainConfig):
    """Weighted loss terms {name: scalar tensor} of a batch (their sum is the training loss) and
    the logits [B, N, P, V] of block 1's greedy draft (for the train-time acceptance)."""
    import torch

    from . import losses

    a = model.args
    P = a.n_predict
    b1 = block_view(b, 0, P)
    parts = {}
    if a.model_type == "specblock":
        out = model(b1["feats"], b1["anchors"], b1["last"])
        t = specblock_terms(model, out, b, c)
        parts["ce"] = t["ce"]
        parts["rank"] = c.rank_weight * t["rank"]
        if c.distill_weight:
            parts["kd"] = c.distill_weight * t["kd"]
        m = cross_block_shift(c, P)
        if m:
            out2 = cross_block_forward(model, b, out, m)
            t2 = specblock_terms(model, out2, b, c, shift=m)
            w = c.cross_block_weight
            parts["xb_ce"] = w * t2["ce"]
            parts["xb_rank"] = w * c.rank_weight * t2["rank"]
            if c.distill_weight:
                parts["xb_kd"] = w * c.distill_weight * t2["kd"]
        metric_logits = out.logits
    else:
        labels_d = model.vocab.t2d(b1["labels"])
        valid = b1["valid"]
        out = model(b1["feats"], b1["anchors"], b1["last"])
        lq = losses.gather_logp(out.logits, labels_d[:, :, None, :].expand(out.logits.shape[:-1]))
        if c.loss == "al":
            # log p_T(label): the target's top-k log-probs at temperature T (greedy label = top-1)
            lp_t = torch.log_softmax(b1["top_logp"] / c.temperature, -1)
            hit = b1["top_ids"] == b1["labels"][..., None]
            lp = torch.where(hit, lp_t, torch.full_like(lp_t, -30.0)).max(-1).values
            parts["al"] = losses.acceptance_surrogate(lq, lp, valid, c.tau, out.prior_logits)
            if c.nll_weight:
                parts["nll"] = c.nll_weight * losses.mixture_nll(out.logits, out.prior_logits, labels_d, valid)
        else:
            parts["nll"] = losses.mixture_nll(out.logits, out.prior_logits, labels_d, valid)
        z = out.prior_logits.argmax(-1)
        metric_logits = out.logits.gather(2, z[:, :, None, None, None].expand(-1, -1, 1, *out.logits.shape[3:]))[:, :, 0]
    return parts, metric_logits


def compute_loss(model, b, c: TrainConfig):
    """-> (loss, {term: float}, train-time acceptance of block 1)."""
    import torch

    parts, metric_logits = loss_terms(model, b, c)
    loss = sum(parts.values())
    b1 = block_view(b, 0, model.args.n_predict)
    with torch.no_grad():
        draft = model.vocab.to_target(metric_logits.argmax(-1))
        acc = accepted_lengths(draft, b1["labels"], b1["data_next"], b1["valid"]).float().mean()
    return loss, {k: float(v.detach()) for k, v in parts.items()}, float(acc)


def save_checkpoint(out: Path, model, opt, c: TrainConfig, step: int, history: list) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "drafter.safetensors.tmp"))
    os.replace(out / "drafter.safetensors.tmp", out / "drafter.safetensors")
    torch.save({"optimizer": opt.state_dict(), "step": step}, out / "optimizer.pt.tmp")
    os.replace(out / "optimizer.pt.tmp", out / "optimizer.pt")
    meta = dict(model_args=dataclasses.asdict(model.args), config=dataclasses.asdict(c), step=step,
                history=history)
    (out / "drafter.json.tmp").write_text(json.dumps(meta, indent=1))
    os.replace(out / "drafter.json.tmp", out / "drafter.json")


def load_drafter(ckpt_dir: str | os.PathLike, target=None):
    """Rebuild a drafter from its checkpoint folder or its GGUF (`checkpoint.load_checkpoint`:
    BlockspecError, one line, for anything else) and bind a loaded target's embeddings/head."""
    from blockspec.models.checkpoint import load_checkpoint

    model, meta = load_checkpoint(ckpt_dir)
    if target is not None:
        model.bind_target(target.tok_embeddings.weight, target.head_weight)
    return model, meta


def heldout_blocks(drafter: str, data: str, target_path: str, n_batches: int, walk: bool = False):
    """(model, blocks): a drafter (checkpoint dir or GGUF) and a generator of the held-out blocks
    `train eval` scores on a self-distilled cache (every prompt of an evaluation set), n_batches
    batches of 8 rows x 16 blocks with a fixed seed, each the block view with the rows' whole
    token sequences added as "tokens" [B, T] (what the diagnostic scripts in benchmarks/ read).
    walk: instead, one batch per held-out row holding the blocks greedy serving drafts there
    (`walk_row`, as `train eval --walk` counts passes); n_batches is then unused."""
    from . import data as data_mod
    from .target import load_target

    model, _ = load_drafter(drafter, load_target(target_path))
    model.eval()
    P = model.args.n_predict
    source = data_mod.open_feature_cache(data, list(model.args.target_layers))
    split = Batches(source, P, 1.0 if source.meta.get("eval_set") else 0.1, seed=0)
    split.require_heldout(data)

    def blocks():
        rng = np.random.default_rng(12345)
        for _ in range(n_batches):
            yield block_view(split.get_batch("heldout", 8, 16, rng, span=P, tokens=True), 0, P)

    def walked():
        import torch

        with torch.no_grad():
            for r in split.split["heldout"].tolist():
                anchors, _ = walk_row(model, split, r)
                if len(anchors):
                    yield block_view(split.batch_at(np.array([r]), anchors[None], tokens=True), 0, P)

    if walk:
        return model, walked()

    return model, blocks()


def cache_metas(data: str) -> dict[str, dict]:
    """Each comma-separated cache dir of --data with its meta.json; BlockspecError, one line, naming
    a dir that holds no feature cache."""
    from blockspec.runtime.errors import BlockspecError

    metas = {}
    for d in data.split(","):
        if not (Path(d) / "meta.json").exists():
            raise BlockspecError(f"--data {d}: no feature cache there (build one with `blockspec train data` "
                                 f"or `train features`)")
        metas[d] = json.loads((Path(d) / "meta.json").read_text())
    return metas


def feature_source(c: TrainConfig, target, layers):
    """The batch source `c.features` names: the cache in c.data, or on-the-fly features of the
    text the cache builder would read."""
    from . import data

    if c.features == "cache":
        from blockspec.runtime.errors import BlockspecError

        for d, meta in cache_metas(c.data).items():
            if meta.get("eval_set"):
                raise BlockspecError(f"--data {d}: an evaluation set (`train data --eval-set`); it is never "
                                     f"trained on, only `blockspec train eval` reads it")
        try:
            return data.open_feature_cache(c.data, layers)
        except ValueError as e:
            raise BlockspecError(f"--data: {e}") from None
    return data.OnlineFeatures.from_text(target, c.target, layers, sources=[s for s in c.sources.split(",") if s],
                                         n_seqs=c.n_seqs, max_len=c.max_len)


def train(c: TrainConfig, target=None, progress: bool = True, source=None) -> dict:
    """Train a drafter per `c`; returns the final held-out estimate. Resumes from c.out if a
    checkpoint is there (and c.resume). `source`: a feature source to use instead of the one
    `c.features` names (tests: on-the-fly features of given token lists)."""
    import torch
    from tqdm import tqdm

    from . import build_model
    from .common import resolve_device
    from .target import load_target

    check_config(c if source is None else dataclasses.replace(c, features=source.kind, data=c.data or "-"))
    device = resolve_device(c.device)  # before anything loads: a device this torch lacks fails at once
    if c.threads:
        torch.set_num_threads(c.threads)
    torch.manual_seed(c.seed)
    out = Path(c.out)
    if target is None:
        target = load_target(c.target)
    if c.init:  # fine-tuning: the drafter's own shape, vocabulary and feature scale
        from blockspec.runtime.errors import BlockspecError

        from .checkpoint import load_checkpoint

        model, _ = load_checkpoint(c.init)
        if model.args.model_type != c.method:
            raise BlockspecError(f"--init {c.init} is a {model.args.model_type} drafter, not {c.method}")
        if c.block_size and c.block_size != model.args.block_size:
            model.resize_block(c.block_size)
        if c.n_layer and c.n_layer != model.args.n_layer:
            if c.n_layer < model.args.n_layer:
                raise BlockspecError(f"--n-layer {c.n_layer}: --init {c.init} has {model.args.n_layer} layers "
                                     f"(a fine-tune keeps them or grows them)")
            model.grow_layers(c.n_layer)
        if c.ffn_dim and c.ffn_dim != model.args.ffn_dim:
            if c.ffn_dim < model.args.ffn_dim:
                raise BlockspecError(f"--ffn-dim {c.ffn_dim}: --init {c.init} has {model.args.ffn_dim} FFN units "
                                     f"(a fine-tune keeps them or widens them)")
            model.grow_ffn(c.ffn_dim)
        grown_layers = []
        if c.target_layers and [int(x) for x in c.target_layers] != [int(x) for x in model.args.target_layers]:
            try:
                grown_layers = model.grow_target_layers(c.target_layers)
            except ValueError as e:
                raise BlockspecError(f"--target-layers with --init {c.init}: {e}") from None
        if c.repick_size and c.repick_size != model.args.draft_vocab_size:
            if not model.args.draft_vocab_size:
                raise BlockspecError(f"--repick-size: --init {c.init} shares the target's head (no draft vocabulary)")
            model.args.draft_vocab_size = c.repick_size  # the re-pick below (or the resumed checkpoint) fills it
        margs = dataclasses.asdict(model.args)
        print(json.dumps(dict(init=c.init, block_size=model.args.block_size, n_layer=model.args.n_layer,
                              ffn_dim=model.args.ffn_dim, draft_vocab=model.args.draft_vocab_size,
                              target_layers=model.args.target_layers)),
              flush=True)
    else:
        grown_layers = []
        margs = make_model_args(c, target.args)
        model = build_model(margs)
    if source is None:
        source = feature_source(c, target, margs["target_layers"])
    model.bind_target(target.tok_embeddings.weight, target.head_weight)
    resuming = c.resume and (out / "drafter.json").exists()
    if resuming and model.vocab.draft_vocab_size != margs["draft_vocab_size"]:
        model.vocab.resize(margs["draft_vocab_size"])  # --repick-size: the checkpoint's head
    if margs["draft_vocab_size"] and (not c.init or (c.repick_vocab and not resuming)):
        # frequency-based draft vocabulary: the training labels (cache) or the text (on-the-fly)
        counts = source.label_counts(margs["vocab_size"])
        d2t = torch.from_numpy(np.argsort(-counts, kind="stable")[: margs["draft_vocab_size"]].copy())
        total = max(1, counts.sum())
        info = dict(draft_vocab=margs["draft_vocab_size"])
        if c.init:  # a trained head row follows its token; a new token starts near the trained rows
            info["init_coverage"] = round(float(counts[model.vocab.d2t.numpy()].sum() / total), 4)
            info["kept"] = model.vocab.repick(d2t, target.head_weight)
        else:
            model.vocab.set_vocab(d2t, target.head_weight)
        info["label_coverage"] = round(float(counts[d2t.numpy()].sum() / total), 4)
        print(json.dumps(info), flush=True)
    if c.feature_scale and not c.no_target_features and (not c.init or grown_layers):
        # 1/RMS per feature dimension over up to 64 training rows, positions 1..len-1 (position 0
        # carries the attention-sink outliers); a fine-tune keeps its drafter's scale (folded into fc
        # in a GGUF) and fits only the layers it grew; a checkpoint resumed below keeps its own scale
        n_train = max(1, int(len(source.lengths) * (1 - c.heldout_frac)))
        idx = np.random.default_rng(c.seed).permutation(n_train)[:64]
        feats, lengths = source.rows(idx)["feats"], source.lengths[idx]
        pos = np.arange(feats.shape[1])
        keep = model.feat_scale.clone()
        model.fit_feature_scale(torch.from_numpy(
            feats[(pos[None] >= 1) & (pos[None] < lengths[:, None])].astype(np.float32)))
        if c.init:  # only the grown layers' dimensions take the fitted scale
            fitted = {lid: model.layer_scale(lid).clone() for lid in grown_layers}
            model.feat_scale.copy_(keep)
            for lid, sc in fitted.items():
                model.set_layer_scale(lid, sc)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 matmuls: training, not the bit-exact runtime
    model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=c.lr,
                            weight_decay=c.weight_decay, betas=(0.9, 0.95))
    step, history = 0, []
    if resuming:
        from safetensors.torch import load_file

        prev = json.loads((out / "drafter.json").read_text())
        model.load_state_dict(load_file(str(out / "drafter.safetensors")))
        st = torch.load(out / "optimizer.pt", weights_only=False, map_location="cpu")  # moved to the params' device
        opt.load_state_dict(st["optimizer"])
        step, history = prev["step"], prev.get("history", [])
        print(f"resumed from {out} at step {step}")
    batches = Batches(source, model.args.n_predict, c.heldout_frac, c.seed + step)
    batches.require_heldout(c.data)
    if c.serve_anchors:
        out.mkdir(parents=True, exist_ok=True)
        batches.train_anchors = serve_anchors(model, batches, batches.split["train"], out / "serve_anchors.npz",
                                              progress)
    span = cross_block_shift(c, model.args.n_predict) + model.args.n_predict
    model.train()
    bar = tqdm(total=c.steps, initial=step, desc=f"train {c.method} ({device.type}, {c.precision})", disable=not progress)
    t0, tok, t_data = time.time(), 0, 0.0
    last_eval = None
    while step < c.steps:
        lr = get_lr(step, c)
        for g in opt.param_groups:
            g["lr"] = lr
        td = time.time()
        b = to_device(batches.get_batch("train", c.batch_size, c.anchors_per_seq, span=span), device)
        t_data += time.time() - td
        if c.no_target_features:
            b["feats"].zero_()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=c.precision == "bf16"):
            loss, parts, acc = compute_loss(model, b, c)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if c.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c.grad_clip)
        opt.step()
        step += 1
        tok += int(b["valid"][:, :, :model.args.n_predict].sum())
        bar.update(1)
        if step % c.log_every == 0 or step == c.steps:
            rate = tok / max(1e-6, time.time() - t0)
            msg = dict(step=step, loss=round(float(loss.detach()), 4), lr=round(lr, 6), train_accept=round(acc, 3),
                       tok_per_s=round(rate, 1), data_frac=round(t_data / max(1e-6, time.time() - t0), 3),
                       **{k: round(v, 4) for k, v in parts.items()})
            print(json.dumps(msg), flush=True)
        if step % c.eval_every == 0 or step == c.steps:
            last_eval = estimate_acceptance(model, batches, c)
            history.append(dict(step=step, **last_eval))
            print(json.dumps(dict(step=step, heldout=last_eval)), flush=True)
        if step % c.save_every == 0 or step == c.steps:
            save_checkpoint(out, model, opt, c, step, history)
    bar.close()
    if last_eval is None:
        last_eval = estimate_acceptance(model, batches, c)
    return last_eval


def tau_by_block(hist: Sequence[int]) -> dict[int, float]:
    """Chain tau at each power-of-two block size up to the drafter's, from the accepted-prefix
    histogram of its full blocks: a block of b drafts accepts min(L, b) (the block is causal for
    SpecBlock, so its first b positions draft what a b-block would; for DBlast, whose positions
    all see the whole block, only an approximation of a b-block's)."""
    h = np.asarray(hist, dtype=np.float64)
    n, P = max(1.0, h.sum()), len(h) - 1
    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32) if b < P} | {P})
    return {b: round(1 + float((np.minimum(np.arange(P + 1), b) * h).sum() / n), 4) for b in sizes}


def evaluate_drafter(drafter: str, data: str, target_path: str, n_batches: int = 32, batch_size: int = 8,
                     anchors: int = 16, heldout_frac: float = 0.1, target=None,
                     by_source: Callable[[Sequence[str], int], list[str]] | None = None, device: str = "auto",
                     walk: bool = False, n_prompts: int | None = None) -> dict:
    """The held-out estimate of a drafter (checkpoint dir or GGUF) on a self-distilled cache: the
    same blocks `train` evaluates (held-out prompts' greedy answers, anchored in the answers, every
    answer token weighted alike). accept = expected accepted prefix of a greedy block, so the
    chain's tau (tokens per target pass) is 1 + accept; tau_by_block the same at smaller blocks.
    by_source: the same estimate on each source's held-out prompts alone (n_batches each), the
    source of each prompt index named by by_source(cache sources, n) (data_engine.prompt_source_names).
    walk: also `walk_acceptance` on every held-out answer (what the bench measures on those prompts);
    n_prompts: only the cache's first n prompts (its prompt order: round-robin over its sources)."""
    from blockspec.runtime.errors import BlockspecError

    from . import data as data_mod
    from .common import resolve_device
    from .target import load_target

    dev = resolve_device(device)
    cache_metas(data)
    target = target or load_target(target_path)
    model, meta = load_drafter(drafter, target)
    model.to(dev)
    a = model.args
    source = data_mod.open_feature_cache(data, list(a.target_layers))
    if getattr(source, "answer_start", None) is None:
        raise BlockspecError(f"--data {data}: not a self-distilled cache (`blockspec train data`)")
    c = TrainConfig(method=a.model_type, batch_size=batch_size, anchors_per_seq=anchors, eval_batches=n_batches)
    if source.meta.get("eval_set"):  # evaluation prompts: every one is held out
        heldout_frac = 1.0
    batches = Batches(source, a.n_predict, heldout_frac, seed=0)
    if n_prompts is not None:
        batches.restrict("heldout", batches.split["heldout"][source.prompt_idx[batches.split["heldout"]] < n_prompts])
    batches.require_heldout(data)

    def summary(rows, walk_rows: bool):
        res = dict(**_estimate_summary(estimate_acceptance(model, batches, c)), heldout_prompts=len(rows))
        if walk_rows:
            res["walk"] = walk_acceptance(model, batches, rows)
        return res

    held = batches.split["heldout"]
    # with --by-source the sources' walks cover the held-out rows once, and the whole walk is their sum
    out = dict(drafter=str(drafter), **summary(held, walk and by_source is None))
    if by_source is not None:
        names = np.asarray(by_source(source.meta["sources"], int(source.prompt_idx.max()) + 1))
        row_names = names[source.prompt_idx[held]]
        out["by_source"] = {}
        for name in dict.fromkeys(row_names.tolist()):
            batches.restrict("heldout", held[row_names == name])
            out["by_source"][name] = summary(held[row_names == name], walk)
        if walk:
            parts = [v["walk"] for v in out["by_source"].values()]
            out["walk"] = _walk_figures(np.sum([w["accept_hist"] for w in parts], axis=0),
                                        sum(w["tokens"] for w in parts))
    return out


def _estimate_summary(res: dict) -> dict:
    return dict(accept=round(res["accept"], 4), tau=round(1 + res["accept"], 4),
                first_token=round(res["match_per_pos"][0], 4), blocks=res["blocks"],
                match_per_pos=[round(x, 4) for x in res["match_per_pos"]],
                tau_by_block=tau_by_block(res["accept_hist"]))
