"""The model-free n-gram (prompt lookup) drafter: a peer of the model drafters behind the same
`Drafter` interface (it holds no state, so it needs no position bookkeeping)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.drafters.tree import DraftTree


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from
    `max_ngram` down to `min_ngram`) and propose what followed it (a repeating span is
    continued by its period). With `branches` > 1
    the continuations of several distinct matches are merged into a tree."""

    name = "ngram"

    # min_ngram 3: on 10 of the suite's chat prompts (SmolLM2, 128 tokens) 1-token matches
    # raised tau from 1.46 to 1.64 but cut speed from 1.04x to 0.75x of plain: short matches
    # propose wrong blocks that still cost a wider verify
    def __init__(self, block_size: int = 4, min_ngram: int = 3, max_ngram: int = 3, branches: int = 1):
        if block_size < 1 or branches < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram drafter needs block_size >= 1, branches >= 1, 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.branches = branches
        self.max_nodes = block_size * branches
        self.max_leaves = branches

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        h = np.asarray(history)
        n_hist = len(h)
        paths: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            suffix = h[n_hist - n:]
            # candidate starts i of an earlier occurrence h[i:i+n] == suffix, latest first
            windows = np.lib.stride_tricks.sliding_window_view(h[:n_hist - 1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0][::-1]
            for i in hits:
                # what followed the match; where it runs into the present, the text is
                # periodic with period p and continues by copying itself
                p = n_hist - n - i
                ext = h.tolist()
                for _ in range(self.block_size):
                    ext.append(ext[len(ext) - p])
                cont = ext[n_hist:]
                if not cont or tuple(cont) in seen:
                    continue
                seen.add(tuple(cont))
                paths.append(cont)
                if len(paths) == self.branches:
                    break
            if len(paths) == self.branches:
                break
        return DraftTree.from_paths(int(h[-1]), paths)


class LookupFirst:
    """A model drafter with n-gram lookup in front (`--method specblock+ngram`, `dblast+ngram`):
    where the history repeats itself (a match of `min_ngram`+ tokens) the lookup's continuation is
    drafted, and the model drafter is not run; elsewhere the model drafts. The target's greedy
    answers repeat spans (code, lists, restated questions) that the lookup continues exactly, while
    the model covers fresh text, so the two accept on different steps. The choice depends on the
    history alone, so either rule stays lossless (lookup drafts are deterministic: q is None).

    Everything but `propose`, the name and the block size is the model drafter's: it observes
    every committed row, as it must, whichever drafted. The lookup drafts `block_size` tokens, which
    may exceed what the model was trained to draft (a GPU verifies 8 or 16 rows for about the cost
    of one); the model drafts at most its own n_predict."""

    def __init__(self, model, block_size: int, min_ngram: int = 3):
        self.model = model
        self.lookup = NgramDrafter(block_size=block_size, min_ngram=min_ngram, max_ngram=min_ngram)
        self.name = f"{model.name}+ngram"
        self.lookup_steps = 0  # proposals the lookup made (the rest were the model's)

    def __getattr__(self, attr):  # only reached for what this class does not define
        return getattr(self.__dict__["model"], attr)

    @property
    def block_size(self) -> int:
        return self.lookup.block_size

    def set_block_size(self, n: int) -> int:
        """BlockPilot's per-request size: both drafters draft n (the model at most its n_predict)."""
        self.model.set_block_size(n)
        self.lookup.block_size = self.lookup.max_nodes = max(1, int(n))
        return self.lookup.block_size

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        tree = self.lookup.propose(history)
        if len(tree) > 1:
            self.lookup_steps += 1
            return tree
        return self.model.propose(history, sampler)
