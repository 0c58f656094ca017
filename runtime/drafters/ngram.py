"""The model-free n-gram (prompt lookup) drafter: a peer of the model drafters behind the same
`Drafter` interface. Its only state is an index of the history it last saw, extended while the
history grows and rebuilt when it is another one, so it needs no position bookkeeping."""

from __future__ import annotations

from typing import Sequence

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.drafters.store import draft_kind
from blockspec.runtime.drafters.tree import DraftTree


MATCH_CANDIDATES = 8   # of the latest occurrences of the suffix, the longest match is continued
MAX_MATCH = 32         # match lengths are measured up to this
# match-length classes of --block-size auto's acceptance estimates (runtime/engine/policy.py): a
# class is named by its shortest length; its prior (L-1)/L for that length L is close to what a
# drafted token of that class is accepted with on the target's answers to training prompts
# (SmolLM2, 900 answers: 0.68 at L = 3, 0.97 at L >= 12)
MATCH_CLASSES = (3, 5, 8, 12, 16, 32)


class NgramDrafter(Drafter):
    """Prompt lookup: find the earlier occurrences of the last n tokens (n from `max_ngram` down to
    `min_ngram`) and propose what followed the one whose match runs longest backwards (of the latest
    MATCH_CANDIDATES; a repeating span is continued by its period). The tree's `kind` is the class
    of that match length, so `--block-size auto` learns per class how deep a draft pays. With
    `branches` > 1 the continuations of several distinct matches are merged into a tree. Where the
    history has no match and an answer store is given (drafters/store.py: the target's own answers
    to other prompts), the store's continuation of the history's longest suffix is drafted (a chain),
    its kind a ("store", ...) class of its own."""

    name = "ngram"

    # min_ngram 3: on 10 of the suite's chat prompts (SmolLM2, 128 tokens) 1-token matches
    # raised tau from 1.46 to 1.64 but cut speed from 1.04x to 0.75x of plain: short matches
    # propose wrong blocks that still cost a wider verify
    def __init__(self, block_size: int = 4, min_ngram: int = 3, max_ngram: int = 3, branches: int = 1,
                 store=None):
        if block_size < 1 or branches < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram drafter needs block_size >= 1, branches >= 1, 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.branches = branches
        self.max_nodes = block_size * branches
        self.max_leaves = branches
        self.matches = 0  # proposals that found a match (drafted something)
        # the target's answers to other prompts (drafters/store.py), looked up where the history has no match
        self.store = store
        self.store_matches = 0  # of `matches`, the store's
        self._hist: list[int] = []  # the history _starts indexes (see _index)
        self._starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(min_ngram, max_ngram + 1)}

    @property
    def lookup(self) -> "NgramDrafter":  # the engine's cheap first look (runtime/engine/speculative.py)
        return self

    model = None  # no model drafter behind it: without a match the step is plain

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        h = self._index(history)
        n_hist = len(h)
        paths: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        best = 0
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            # starts i of an earlier occurrence h[i:i+n] == the last n tokens, latest first
            hits = self._starts[n].get(tuple(h[n_hist - n:]), ())[::-1]
            if not hits:
                continue
            # the latest few by how far the match runs backwards, longest first (ties: latest)
            lengths = [match_length(h, i, n) for i in hits[:MATCH_CANDIDATES]]
            order = sorted(range(len(lengths)), key=lambda j: -lengths[j])
            for j in [*order, *range(len(lengths), len(hits))]:
                # what followed the match; where it runs into the present, the text is
                # periodic with period p and continues by copying itself
                p = n_hist - n - hits[j]
                cont: list[int] = []
                for k in range(n_hist - p, n_hist - p + self.block_size):
                    cont.append(h[k] if k < n_hist else cont[k - n_hist])
                if not cont or tuple(cont) in seen:
                    continue
                seen.add(tuple(cont))
                paths.append(cont)
                best = max(best, lengths[j] if j < len(lengths) else n)
                if len(paths) == self.branches:
                    break
            if len(paths) == self.branches:
                break
        if not paths and self.store is not None:
            return self._from_store(h)
        tree = DraftTree.from_paths(int(h[-1]), paths)
        if paths:
            self.matches += 1
            tree.kind = max(c for c in MATCH_CLASSES if c <= best) if best >= MATCH_CLASSES[0] else best
            tree.prior = (tree.kind - 1) / tree.kind if tree.kind > 1 else 0.5
        return tree

    def _from_store(self, h: list[int]) -> DraftTree:
        path, n, share = self.store.propose(h, self.block_size)
        tree = DraftTree.from_paths(int(h[-1]), [path] if path else [])
        if path:
            self.matches += 1
            self.store_matches += 1
            tree.kind = draft_kind(n, share)
            tree.prior = self.store.prior(tree.kind)
        return tree

    def check_target(self, target) -> None:
        """A store holds one target's answers: another target refuses it with one line."""
        if self.store is not None:
            from blockspec.runtime.errors import BlockspecError
            from blockspec.runtime.format.drafter_gguf import target_fingerprint

            why = self.store.fits(target_fingerprint(target.path))
            if why:
                raise BlockspecError(why)

    def _index(self, history: Sequence[int]) -> list[int]:
        """`history` as a list, with `_starts[n][gram]` = the starts i of every n-gram that ends
        before the last token (i + n < len), ascending. Kept across calls while the history only
        grows (a generation appends to it); rebuilt when it is another one. Scanning the history
        with numpy each step cost ~0.2 ms a step right after a target decode."""
        h = history if isinstance(history, list) else [int(t) for t in history]
        known = self._hist
        if h[:len(known)] != known:
            known = self._hist = []
            self._starts = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        for n, starts in self._starts.items():
            for i in range(max(len(known) - n, 0), len(h) - n):
                starts.setdefault(tuple(h[i:i + n]), []).append(i)
        known.extend(h[len(known):])  # only the new tokens: the history is not copied each step
        return h


def match_length(h: Sequence[int], i: int, n: int) -> int:
    """How many tokens h[..i+n] and h[..len(h)] agree on, backwards (>= n; at most MAX_MATCH)."""
    end = len(h)
    length = n
    while length < MAX_MATCH and i - (length - n) - 1 >= 0 and h[i - (length - n) - 1] == h[end - length - 1]:
        length += 1
    return length


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

    def __getattr__(self, attr):  # only reached for what this class does not define
        return getattr(self.__dict__["model"], attr)

    @property
    def lookup_steps(self) -> int:
        """Proposals the lookup made (the rest were the model's)."""
        return self.lookup.matches

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
            return tree
        return self.model.propose(history, sampler)
