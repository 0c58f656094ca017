"""A drafter for engine tests: it proposes a continuation known in advance (e.g. the target's own
greedy output), so every draft is accepted; an upper bound on acceptance."""

from __future__ import annotations

from typing import Sequence

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.drafters.tree import DraftTree


class FixedDrafter(Drafter):
    """Proposes `continuation` (the tokens expected at positions start..), block_size at a time."""

    name = "fixed"

    def __init__(self, continuation: Sequence[int], start: int, block_size: int = 4):
        self.continuation = list(continuation)  # tokens expected at positions start..
        self.start = start
        self.block_size = block_size
        self.max_nodes = block_size

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        at = len(history) - self.start  # index of the first token after the root
        return DraftTree.chain(int(history[-1]), self.continuation[at: at + self.block_size])
