"""SpecBlock's cost-aware online adaptation (arXiv 2605.07243): while serving, a bandit decides
after each request whether updating the drafter is worth what the update costs.

Signal. Each verified block yields s = the summed probability error of its rejected tokens: from
the last accepted node, along the drafter's first choice at each depth, sum 1 - p(d_k) where p is
the target's softmax (its raw logits, T = 1, whatever the request's sampling) at the rejected
node's parent, read from the verify logits the step already has. s is the drafted tokens the
target's distribution did not back, so it is the room an update has to win accepted tokens.

Gain and cost. The bandit keeps EWMAs of s per block, blocks per request, seconds per speculative
pass and tau, and per update kind (head-only, full) an EWMA `effect` of the accepted tokens per
block an update of that kind wins and an EWMA of its measured cost in seconds. The effect is
measured when the update runs, on held-back blocks: the newest request is never trained on; the
torch copy drafts its blocks (teacher-forced on the committed tokens, no target pass) before and
after the update, and the effect is the change in the accepted prefix per block. An update is kept
only when that change is above `keep_z` (2) standard errors of the per-block differences; any other
is undone (the torch copy restored, nothing written to llama.cpp), so serving does not draft with
weights whose gain on the newest request is within noise. The expected throughput gain of kind a,
in seconds saved over `horizon` requests, is

    gain(a) = effect(a) * blocks * horizon * pass_s / tau

(an extra accepted token per block saves pass_s / tau of a request's time per block), and 0 while
the drafter is never wrong (s = 0: nothing to win). Skip gains and costs nothing; an update runs
only when gain(a) > cost(a) for the best a. Optimism explores: an untried kind has cost 0 and
effect `prior_effect`, so each kind is tried once while there is any signal, and a kind whose
measured effect does not pay its cost stops being chosen.

Updates. The session keeps its recent requests as examples: the committed tokens and the
target taps the drafter already holds for them (GgmlBlockDrafter._feats), anchored where the target
answered; all but the newest are trained on, the newest measures the effect. Head-only trains the
draft head (the output projection over the draft vocabulary) on the trunk's hidden states, full
trains every drafter weight; both take a few Adam steps of the
valid-prefix cross-entropy (models/losses.py, as models/train.py; full adds the rank head's loss)
on a float32 torch copy of the drafter (models/checkpoint.py), which stays the master copy so
quantisation error never accumulates. The changed tensors go into the llama.cpp drafter's weights
in place (GgmlBlockDrafter.set_tensor, patch 0009; q8_0 requantised by ggml), nothing reloads.

When. Updates run after a request has finished (generate_stream, after its cache is trimmed),
never inside a step: no step of a request is slower than without --adapt, apart from the signal
(a softmax over the vocabulary per rejected depth, reported as `signal_s`). Output stays lossless
because only the drafter changes, and acceptance never trusts the drafter.

A full update changes fc, cond_norm and every layer's wk / wv, from which the drafter's cached
context K/V were computed. They are recomputed (GgmlBlockDrafter.refresh_context: one feature pass
over the held rows, from the features it keeps) as part of the update and its measured cost, so
the next request's reused prefix is drafted as the new weights would. Stale rows would be lossless
too (they only make drafts worse); recomputing keeps the bandit's measurement of the update honest.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from blockspec.runtime.errors import BlockspecError

UPDATES = ("head", "full")
ACTIONS = ("skip",) + UPDATES


def rejection_signal(tree, logits: np.ndarray, verdict) -> float:
    """Summed probability error of a verified block's rejected tokens (module docstring): from the
    last accepted node along first children, sum of 1 - p(token) under softmax(logits[parent]).
    tree: DraftTree, logits [n_nodes, n_vocab] (row i: the target after node i), verdict: Verdict."""
    kids = tree.children()
    node = verdict.accepted[-1] if verdict.accepted else 0
    s = 0.0
    while kids[node]:
        child = kids[node][0]  # the drafter's first choice (trees are built best first)
        row = logits[node]
        m = float(row.max())
        z = float(np.exp(row - m, dtype=np.float32).sum())
        s += 1.0 - math.exp(float(row[tree.tokens[child]]) - m) / z
        node = child
    return s


@dataclass
class AdaptConfig:
    alpha: float = 0.3  # EWMA weight of the newest observation
    horizon: float = 8.0  # requests an update's gain is counted over
    prior_effect: float = 0.05  # accepted tokens per block an untried update kind is assumed to win
    steps: dict = field(default_factory=lambda: {"head": 8, "full": 4})  # Adam steps per update
    lr: dict = field(default_factory=lambda: {"head": 1e-3, "full": 1e-4})
    rank_weight: float = 0.1  # the rank head's loss in a full update (models/train.py's default)
    memory: int = 8  # recent requests kept as examples
    min_examples: int = 4  # requests held before the first update: the newest measures, the rest train
    keep_z: float = 2.0  # an update is kept when its gain on the held-back blocks is this many standard errors
    max_anchors: int = 64  # blocks per request per update step
    seed: int = 0


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1.0 - alpha) * old + alpha * new


class CostAwareBandit:
    """Skip / head-only / full, from signals, measured effects and measured costs (module
    docstring). Pure: numbers in, an action out; the Adapter runs what it chooses and reports the
    update's cost and effect back."""

    def __init__(self, config: AdaptConfig | None = None):
        self.cfg = c = config or AdaptConfig()
        self.signal: float | None = None  # EWMA of s per block
        self.blocks: float | None = None  # EWMA of blocks per request
        self.pass_s: float | None = None  # EWMA of seconds per speculative pass
        self.tau: float | None = None
        self.effect = {a: c.prior_effect for a in UPDATES}  # EWMA of accepted tokens per block won
        self.cost: dict[str, float | None] = {a: None for a in UPDATES}
        self.count = {a: 0 for a in ACTIONS}
        self.available = set(UPDATES)

    def end_request(self, signal: float, blocks: int, pass_s: float, tau: float) -> None:
        """A request's mean signal per block, its block count, seconds per pass and tau."""
        if blocks <= 0:
            return
        a = self.cfg.alpha
        self.signal = _ewma(self.signal, signal, a)
        self.blocks = _ewma(self.blocks, float(blocks), a)
        self.pass_s = _ewma(self.pass_s, pass_s, a)
        self.tau = _ewma(self.tau, max(tau, 1.0), a)

    def gain(self, kind: str) -> float:
        """Expected seconds an update of `kind` saves over the horizon (0 before any request, and
        while the drafter is never wrong)."""
        if kind == "skip" or self.signal is None or self.signal <= 1e-9:
            return 0.0
        return self.effect[kind] * self.blocks * self.cfg.horizon * self.pass_s / self.tau

    def net(self, kind: str) -> float:
        return self.gain(kind) - (self.cost[kind] or 0.0) if kind != "skip" else 0.0

    def choose(self) -> str:
        """The update whose gain exceeds its cost by the most, else skip."""
        best, best_net = "skip", 0.0
        for kind in UPDATES:  # head first: on a tie the cheaper kind
            if kind in self.available and self.net(kind) > best_net:
                best, best_net = kind, self.net(kind)
        self.count[best] += 1
        return best

    def record_update(self, kind: str, seconds: float, effect: float) -> None:
        """An update of `kind` ran, took `seconds` and changed the held-back blocks' accepted
        tokens per block by `effect` (an update that did not help was undone, at that cost)."""
        self.cost[kind] = _ewma(self.cost[kind], seconds, self.cfg.alpha)
        self.effect[kind] = _ewma(self.effect[kind], effect, self.cfg.alpha)


@dataclass
class _Example:
    feats: np.ndarray  # [S, F] target taps of the held rows 0..S-1
    tokens: np.ndarray  # [S + 1] committed tokens (the last one has no row)
    first: int  # first anchor: the last prompt position


class Adapter:
    """`--adapt`: the bandit, the session's examples and the torch copy of a ggml SpecBlock drafter.
    The engine calls `begin_request`, `record_block` per verified block (speculative.py) and
    `after_request` once a request is done (generate.py), which may update the drafter."""

    def __init__(self, drafter, target, config: AdaptConfig | None = None):
        from blockspec.models.checkpoint import read_drafter_gguf
        from blockspec.runtime.drafters.torch_backend import _target_weights

        self.drafter = drafter
        self.cfg = config or AdaptConfig()
        self.bandit = CostAwareBandit(self.cfg)
        drafter.make_writable()
        model, _ = read_drafter_gguf(drafter.path)
        embed, head = _target_weights(str(target.path), _mtime(target.path), not model.args.draft_vocab_size)
        self.model = model.bind_target(embed, head).train()
        if model.vocab.lm_head is None:  # the target's head is shared (and frozen): nothing to tune alone
            self.bandit.available.discard("head")
        self.examples: deque[_Example] = deque(maxlen=self.cfg.memory)
        self._opt: dict = {}
        self._rng = np.random.default_rng(self.cfg.seed)
        self.updates = {a: 0 for a in UPDATES}  # updates kept (written into the ggml drafter)
        self.undone = {a: 0 for a in UPDATES}  # updates that did not help the held-back blocks
        self.update_s = 0.0
        self._warm_up()
        self.begin_request()

    def _warm_up(self) -> None:
        """torch's first backward and optimizer step pay a one-off second or so (lazy imports and
        kernels): pay it here, so the bandit's first measured cost is what an update costs."""
        import torch

        m, a = self.model, self.model.args
        out = m(torch.zeros(1, 1, len(a.target_layers) * a.target_dim), torch.zeros(1, 1, dtype=torch.long),
                torch.zeros(1, 1, dtype=torch.long))
        (out.logits.float().mean() + out.rank_logits.float().mean()).backward()
        for kind in UPDATES:
            if kind in self.bandit.available:
                params = self._params(kind)
                for p in params:
                    p.grad = torch.zeros_like(p)
                torch.optim.Adam(params, lr=0.0).step()  # lr 0, zero gradients: no weight changes
        m.zero_grad(set_to_none=True)

    def _params(self, kind: str):
        return list(self.model.vocab.lm_head.parameters()) if kind == "head" else list(self.model.parameters())

    # ------------------------------------------------------------------ per request
    def begin_request(self) -> None:
        self._signals: list[float] = []
        self._signal_s = 0.0

    def record_block(self, tree, logits: np.ndarray, verdict) -> None:
        if len(tree) < 2:  # a plain step (--block-size auto chose depth 0): nothing was drafted
            return
        t0 = time.perf_counter()
        self._signals.append(rejection_signal(tree, logits, verdict))
        self._signal_s += time.perf_counter() - t0

    def after_request(self, tokens, prompt_len: int, stats) -> str:
        """Keep the request as an example, let the bandit choose, run the update; fill stats.adapt."""
        d = self.drafter
        held = len(d.tokens)
        if held and held <= len(tokens) and prompt_len <= held:
            self.examples.append(_Example(d._feats[:held].copy(), np.asarray(tokens[:held + 1], dtype=np.int64),
                                          prompt_len - 1))
        n = len(self._signals)
        signal = float(np.mean(self._signals)) if n else 0.0
        passes = max(1, stats.target_passes)
        self.bandit.end_request(signal, n, (stats.draft_s + stats.verify_s) / passes, stats.tau)
        action = self.bandit.choose() if n else "skip"
        done = self.update(action) if action != "skip" else None
        if done is None:  # skipped, or no example to learn from or to measure on yet
            action, (seconds, effect, kept) = "skip", (0.0, 0.0, False)
        else:
            seconds, effect, kept = done
            self.bandit.record_update(action, seconds, effect)
        stats.adapt = dict(action=action, update_s=seconds, effect=effect, kept=kept, signal=signal, blocks=n,
                           signal_s=self._signal_s, updates=dict(self.updates), undone=dict(self.undone),
                           update_s_total=self.update_s)
        self.begin_request()
        return action

    # ------------------------------------------------------------------ updates
    def update(self, kind: str, keep_worse: bool = False) -> tuple[float, float, bool] | None:
        """A few Adam steps of `kind` on the session's examples but the newest, measured on the newest
        (the accepted tokens per block its blocks gain, drafted by the torch copy before and after).
        A gain above `keep_z` standard errors of the per-block differences (or `keep_worse`) writes
        the changed tensors into the ggml drafter in place (and, full, recomputes its context);
        otherwise the torch copy is restored and nothing changes.
        Returns (seconds, effect, kept), or None while fewer than `min_examples` (at least two)
        requests are held or none has a block."""
        import torch

        if kind not in UPDATES:
            raise BlockspecError(f"unknown update kind {kind!r} (head or full)")
        if kind not in self.bandit.available:
            raise BlockspecError("this drafter shares the target's head: there is no head of its own to update")
        t0 = time.perf_counter()
        if len(self.examples) < max(2, self.cfg.min_examples):
            return None
        *train, held = self.examples
        batches = [b for b in (self._batch(ex) for ex in train) if b is not None]
        val = self._batch(held)
        if not batches or val is None:
            return None
        params = self._params(kind)
        saved = [p.detach().clone() for p in params]
        before = self._accepted(val)
        (self._update_head if kind == "head" else self._update_full)(batches)
        diff = self._accepted(val) - before  # per held-back block
        effect = float(diff.mean())
        kept = effect > self.cfg.keep_z * float(diff.std()) / math.sqrt(len(diff)) or keep_worse
        if kept:
            self._write(kind)
            self.updates[kind] += 1
        else:
            with torch.no_grad():
                for p, v in zip(params, saved):
                    p.copy_(v)
            self._opt.pop(kind, None)  # its moments pointed the way that did not help
            self.undone[kind] += 1
        seconds = time.perf_counter() - t0
        self.update_s += seconds
        return seconds, effect, kept

    def _accepted(self, b) -> np.ndarray:
        """Accepted prefix of each block of batch `b` drafted greedily by the torch copy,
        teacher-forced on the committed tokens."""
        import torch

        with torch.no_grad():
            out = self.model(b["feats"], b["anchors"], b["last"])
            match = (self.model.vocab.to_target(out.logits.argmax(-1)) == b["labels"]) & b["valid"]
            return match.long().cumprod(-1).sum(-1).flatten().numpy().astype(np.float64)

    def _batch(self, ex: _Example):
        """One request's blocks as a training batch: up to max_anchors anchors t >= first (the
        block at t knows x[t+1] and drafts x[t+2..t+1+K]); None when it has none."""
        import torch

        K = self.model.args.block_size
        n = len(ex.tokens)
        lo, hi = ex.first, min(n - 3, ex.feats.shape[0] - 1)
        if hi < lo:
            return None
        all_t = np.arange(lo, hi + 1)
        t = np.sort(self._rng.choice(all_t, size=min(self.cfg.max_anchors, len(all_t)), replace=False))
        pos = t[:, None] + 2 + np.arange(K)  # [N, K] label positions
        valid = pos < n
        labels = ex.tokens[np.minimum(pos, n - 1)]
        return dict(feats=torch.from_numpy(ex.feats[:t[-1] + 1])[None], anchors=torch.from_numpy(t)[None],
                    last=torch.from_numpy(ex.tokens[t + 1])[None], labels=torch.from_numpy(labels)[None],
                    valid=torch.from_numpy(valid)[None])

    def _optimizer(self, kind: str, params):
        import torch

        if kind not in self._opt:
            self._opt[kind] = torch.optim.Adam(params, lr=self.cfg.lr[kind])
        return self._opt[kind]

    def _update_head(self, batches) -> None:
        import torch

        from blockspec.models import losses

        m = self.model
        head = m.vocab.lm_head
        with torch.no_grad():  # the trunk is fixed: its final states once, then steps on the head alone
            hidden = [m(b["feats"], b["anchors"], b["last"]).hidden for b in batches]  # [1, N, K, H] each
        labels = [m.vocab.t2d(b["labels"]) for b in batches]  # draft ids, -1 outside the draft vocabulary
        opt = self._optimizer("head", self._params("head"))
        for _ in range(self.cfg.steps["head"]):
            opt.zero_grad()
            loss = sum(losses.block_cross_entropy(head(h), y, b["valid"])[0]
                       for h, y, b in zip(hidden, labels, batches))
            (loss / len(batches)).backward()
            opt.step()

    def _update_full(self, batches) -> None:
        from blockspec.models import losses
        from blockspec.models.specblock import rank_bucket_labels

        m = self.model
        opt = self._optimizer("full", self._params("full"))
        for _ in range(self.cfg.steps["full"]):
            opt.zero_grad()
            total = 0.0
            for b in batches:
                out = m(b["feats"], b["anchors"], b["last"])
                y = m.vocab.t2d(b["labels"])
                ce, keep = losses.block_cross_entropy(out.logits, y, b["valid"])
                buckets = rank_bucket_labels(out.logits.detach(), y, m.args.rank_widths)
                rank = losses.rank_bucket_cross_entropy(out.rank_logits, buckets, keep)
                total = total + ce + self.cfg.rank_weight * rank
            (total / len(batches)).backward()
            opt.step()

    def _write(self, kind: str) -> None:
        from blockspec.runtime.format.drafter_gguf import torch_to_gguf_name

        d, m = self.drafter, self.model
        if kind == "head":
            d.set_tensor("output.weight", m.vocab.lm_head.weight.detach().numpy())
            return
        for name, value in m.export_state().items():
            if name != "vocab.d2t":
                d.set_tensor(torch_to_gguf_name(name, "specblock"), value.detach().float().numpy())
        d.refresh_context()  # the cached context K/V came from the old fc / wk / wv


def _mtime(path) -> float:
    import os

    return os.path.getmtime(path)


def check_adapt_method(method: str) -> None:
    """Refuse --adapt for a method that has no SpecBlock drafter, before anything loads. DBlast is
    not adapted: its acceptance-length loss needs the target's distribution at every drafted
    position, which serving does not keep (greedy blocks keep only the committed tokens)."""
    if method != "specblock":
        raise BlockspecError(f"--adapt is SpecBlock's online adaptation: it needs --method specblock, not {method}")


def attach_adapter(drafter, target, config: AdaptConfig | None = None) -> Adapter:
    """`--adapt`: give `drafter` its Adapter (drafter.adapter, read by the engine). Only a SpecBlock
    drafter run by llama.cpp adapts: BlockspecError, one line, for anything else."""
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter

    if not isinstance(drafter, GgmlSpecBlockDrafter):
        what = "plain decoding" if drafter is None else \
            f"--method {drafter.name}" + (f" ({drafter.backend} backend)" if drafter.backend else "")
        raise BlockspecError(f"--adapt updates a SpecBlock drafter run by llama.cpp (--method specblock with a GGUF "
                             f"drafter on the ggml backend), not {what}")
    drafter.adapter = Adapter(drafter, target, config)
    return drafter.adapter
