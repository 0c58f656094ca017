"""A draft tree: what every drafter proposes and what the target verifies in one pass.

Node 0 is the root: the last emitted token, not yet in the target's cache. Every other
node i has a token, a parent (parents[i] < i, so nodes are in topological order) and,
optionally, the draft distribution its siblings were drawn from. A chain of K drafted
tokens is the tree with parents [-1, 0, 1, ..., K-1].

For the target pass each leaf gets its own sequence id and a node carries the ids of
all leaves below it, so with a unified KV cache each node attends exactly to the
prefix plus its ancestors: node logits equal those of decoding that path alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int]  # [n_nodes], tokens[0] = root
    parents: list[int]  # [n_nodes], parents[0] = -1
    # q[i]: the law (sampling.Law) node i's token was drawn from, given its parent's path and its
    # earlier siblings (runtime/engine/acceptance.py), or None where it was chosen
    # deterministically (greedy / top-k / lookup); q[0] is None
    q: list = field(default_factory=list)
    # a lookup's draft (runtime/drafters/ngram.py): the kind --block-size auto keys its acceptance
    # estimate by, and the acceptance it expects of a drafted token of that kind; None: a model's
    kind: Hashable = None
    prior: float = 0.5

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parents[0] = -1) and one parent per node")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        if not self.q:
            self.q = [None] * len(self.tokens)

    @classmethod
    def chain(cls, root: int, drafted: list[int], q: list | None = None) -> "DraftTree":
        """root -> d0 -> d1 ...; q[k] (optional) is the distribution d_k was drawn from."""
        tokens = [root, *drafted]
        parents = [-1, *range(len(drafted))]
        return cls(tokens, parents, [None, *q] if q is not None else [])

    @classmethod
    def sampled(cls, root: int, branches: list[list], widths: list[int], max_nodes: int,
                rng: np.random.Generator) -> "DraftTree":
        """A tree of drafts drawn from draft distributions, for rejection sampling.

        `branches[b][k]` is the law (sampling.Law) of depth k's token in branch b (it may not depend on
        the tokens drawn before it in the branch: a block drafter's one pass gives every depth's).
        Each branch is a spine, one token per depth drawn from its law; depth k of the spine also
        gets up to widths[k] - 1 siblings, drawn from the same law without replacement, while the
        `max_nodes` budget lasts (shallow depths first). Every node records the law it was drawn
        from given what was drawn before it: its depth's law with its earlier siblings (same
        branch) removed and renormalised. Branches are drawn independently of each other."""
        tokens, parents, qs = [root], [-1], [None]
        n_spine = sum(min(len(d), max_nodes) for d in branches)
        spare = max(0, max_nodes - n_spine)
        for dists in branches:
            parent = 0
            for k, q in enumerate(dists):
                if len(tokens) - 1 >= max_nodes:
                    break
                extra = min(max(0, widths[k] - 1) if k < len(widths) else 0, spare)
                spine = None
                for tok, law in draw_without_replacement(q, 1 + extra, rng):
                    tokens.append(tok)
                    parents.append(parent)
                    qs.append(law)
                    spine = len(tokens) - 1 if spine is None else spine
                if spine is None:  # a law with no mass left: nothing to draw
                    break
                spare -= len(tokens) - 1 - spine
                parent = spine
        return cls(tokens, parents, qs)

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]]) -> "DraftTree":
        """Merge token paths that share prefixes into one tree (deterministic drafts)."""
        tokens, parents = [root], [-1]
        index: dict[tuple[int, int], int] = {}
        for path in paths:
            node = 0
            for tok in path:
                key = (node, tok)
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = index[key]
        return cls(tokens, parents)

    @classmethod
    def best_first(cls, root: int, cand: list[list[int]], cand_logp: list[list[float]], max_nodes: int) -> "DraftTree":
        """The `max_nodes` most likely paths' nodes from per-depth candidates (`cand[k]` with
        log-probs `cand_logp[k]`, each sorted best first), where a node at depth k may take any of
        depth k+1's candidates. Scores only fall along a path, so a parent always comes before its
        children. (The rank-head tree of SpecBlock, for either backend.)"""
        import heapq

        K = len(cand)
        tokens, parents = [root], [-1]
        heap = [(-cand_logp[0][j], 0, 0, j) for j in range(len(cand[0]))] if K else []  # (-score, parent, depth, rank)
        heapq.heapify(heap)
        while heap and len(tokens) - 1 < max_nodes:
            neg, parent, k, j = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(cand[k][j])
            parents.append(parent)
            if k + 1 < K:
                for j2 in range(len(cand[k + 1])):
                    heapq.heappush(heap, (neg - cand_logp[k + 1][j2], node, k + 1, j2))
        return cls(tokens, parents)

    def prefix(self, n: int) -> "DraftTree":
        """The first n nodes: still a tree, since parents precede their children."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.q[:n], self.kind, self.prior)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], start=1):
            out[p].append(i)
        return out

    def depths(self) -> list[int]:
        d = [0] * len(self.tokens)
        for i, p in enumerate(self.parents[1:], start=1):
            d[i] = d[p] + 1
        return d

    def leaves(self) -> list[int]:
        has_child = set(self.parents[1:])
        return [i for i in range(len(self.tokens)) if i not in has_child]

    def path(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        out = []
        while node != -1:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def seq_ids(self, base: int = 1) -> tuple[list[list[int]], list[int]]:
        """(per-node sequence ids, leaf of each id): leaf j gets id base + j and every node
        carries the ids of the leaves below it."""
        leaves = self.leaves()
        ids: list[list[int]] = [[] for _ in self.tokens]
        for j, leaf in enumerate(leaves):
            for node in self.path(leaf):
                ids[node].append(base + j)
        return ids, leaves


def draw_without_replacement(q, n: int, rng: np.random.Generator) -> list[tuple]:
    """Up to n distinct tokens from q (a sampling.Law), one at a time; each with the law it was drawn
    from (q with the earlier ones removed, renormalised). Inverse CDF on one uniform per token."""
    out: list[tuple] = []
    law = q.normalized()
    for _ in range(n):
        if law is None:
            break
        tok = law.draw(rng)
        out.append((tok, law))
        law = law.without(tok)
    return out
