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

    def propose(self, history: Sequence[int]) -> DraftTree:
        """A tree rooted at history[-1] (the last emitted token, not yet in the cache)."""
        raise NotImplementedError
