"""The drafter interface (the n-gram drafter and the block drafters implement it).

A drafter sees the committed tokens (and, if it asks for them, the target's layer taps
for every committed row) and proposes a `DraftTree` rooted at the last emitted token.
The engine keeps it in step with the target's cache by position:
`trim(n)` forgets everything from position n on, `observe(tokens, start, feats)` adds
committed rows at positions start.. . Acceptance never looks inside a drafter.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from blockspec.runtime.drafters.tree import DraftTree


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Drafter:
    name = "base"
    backend: str | None = None  # "torch", "ggml", or None for model-free drafters
    target_layers: tuple[int, ...] = ()  # layer taps this drafter is conditioned on
    max_nodes = 8  # drafted nodes per tree (root excluded): the verify batch is max_nodes + 1
    max_leaves = 1  # sequence ids the tree needs besides the main one

    def check_target(self, target) -> None:
        """Raise BlockspecError naming the mismatch if this drafter cannot serve `target`."""

    def trim(self, n: int) -> None:
        """Forget committed rows at positions >= n."""

    def held_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` this drafter already holds state for. The engine reuses
        at most that much of the target's cached prompt (a model-free drafter needs none)."""
        return len(tokens)

    def observe(self, tokens: Sequence[int], start: int, feats: dict[int, np.ndarray] | None) -> None:
        """Committed rows: tokens at positions start.., with their target taps [n, n_embd] per layer."""

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        """A tree rooted at history[-1] (the last emitted token, not yet in the cache). With a
        `sampler` (engine/sampling.DraftSampler: `law(logits)` and `rng`), a drafter that
        `samples_drafts` draws its tokens from its own distribution and records the law of each
        node (DraftTree.q, a sampling.Law); otherwise (and always at T = 0) its drafts are deterministic."""
        raise NotImplementedError

    samples_drafts = False  # can draw its drafts from its own distribution (propose's sampler)


class BlockDrafter(Drafter):
    """The position bookkeeping every model drafter shares: the token at each row it holds
    (`tokens`), the prefix it can reuse, trimming, the checks on observed rows, and the anchor of a
    block. A backend only runs passes: `_context(x, start)` over new rows of conditioning features
    x [n, n_layers * target_dim] at positions start.., and `_forget(n)` of its rows from n on."""

    def __init__(self):
        self.tokens: list[int] = []  # token at each held position (to catch an out-of-step engine)

    def held_prefix(self, tokens: Sequence[int]) -> int:
        return common_prefix(tokens, self.tokens)

    def trim(self, n: int) -> None:
        if n < len(self.tokens):
            self._forget(n)
            del self.tokens[n:]

    def observe(self, tokens: Sequence[int], start: int, feats: dict[int, np.ndarray] | None) -> None:
        if start > len(self.tokens):
            raise RuntimeError(f"{self.name} drafter: rows from position {start} observed but it holds only "
                               f"{len(self.tokens)} (the drafter must see every committed row)")
        if feats is None or any(lid not in feats for lid in self.target_layers):
            raise RuntimeError(f"{self.name} drafter needs taps of target layers {list(self.target_layers)}")
        self.trim(start)
        x = np.ascontiguousarray(np.concatenate(
            [np.asarray(feats[lid], dtype=np.float32) for lid in self.target_layers], axis=-1))
        if x.shape[0] != len(tokens):
            raise RuntimeError(f"{self.name} drafter: {len(tokens)} tokens but {x.shape[0]} feature rows")
        self._context(x, start)
        self.tokens.extend(int(t) for t in tokens)

    def set_block_size(self, n: int) -> int:
        """Draft n tokens per block from now on, clipped to 1..n_predict (the most the drafter was
        trained to draft); BlockPilot's per-request choice (runtime/engine/pilot.py). Returns the size
        set. A tree keeps its node budget, a chain's budget is its block."""
        self.block_size = max(1, min(int(n), int(self.n_predict)))
        self._resized()
        return self.block_size

    def _resized(self) -> None:
        """Recompute what depends on block_size (node budgets)."""

    def _context(self, x: np.ndarray, start: int) -> None:
        raise NotImplementedError

    def _forget(self, n: int) -> None:
        raise NotImplementedError

    samples_drafts = True

    def _sampled_tree(self, root: int, branch_logits: Sequence[np.ndarray], widths: Sequence[int], sampler,
                      d2t: np.ndarray | None) -> DraftTree:
        """Drafts drawn from the drafter's own laws: `branch_logits[b]` [depths, Vd] over the draft
        vocabulary (`d2t` maps its ids to the target's; None: they are the target's), each row's law
        the request's sampler chain applied to it (`sampler.law`). DraftTree.sampled shapes the tree."""
        laws = []
        for logits in branch_logits:
            rows = []
            for row in np.asarray(logits, dtype=np.float32):
                law = sampler.law(row)
                rows.append(law if d2t is None else law.remap(d2t))
            laws.append(rows)
        return DraftTree.sampled(root, laws, list(widths), self.max_nodes, sampler.rng)

    def _anchor(self, history: Sequence[int]) -> int:
        """t = len(history) - 2, the last held position: the block rooted at history[-1] = x[t+1]
        is anchored there."""
        t = len(history) - 2
        if len(self.tokens) != t + 1 or list(history[:t + 1]) != self.tokens:
            raise RuntimeError(f"{self.name} drafter out of step: it holds {len(self.tokens)} rows, "
                               f"the history has {t + 1} committed tokens")
        return t
