"""One speculative step: draft a tree, verify it in one target decode, accept, commit.

The reference loop is upstream's speculative-simple: evaluate [root, drafted...] in one
batch, accept a prefix, trim the cache — generalised to trees with one sequence id per
leaf (runtime/drafters/tree.py). The cache is restored in `finally`, so an exception or Ctrl-C
never leaves tree cells behind: after a step the cache holds exactly the committed
tokens except the last emitted one, as after a plain step.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np

from blockspec.runtime.engine.acceptance import Verdict, accept
from blockspec.runtime.engine.sampling import DraftSampler, SamplingParams, sample
from blockspec.runtime.drafters.tree import DraftTree

MAIN_SEQ = 0


def acceptance_rule(sampling: SamplingParams, drafter) -> str:
    """The rule a run uses (Stats.acceptance): `greedy` at T = 0; at T > 0 `rejection` where the
    request asks for it and the drafter can draw from its own distribution, else `match`."""
    if sampling.greedy:
        return "greedy"
    if sampling.acceptance == "rejection" and getattr(drafter, "samples_drafts", False):
        return "rejection"
    return "match"


def verify_tree(target, tree: DraftTree, n_past: int, taps: tuple[int, ...] = ()):
    """Decode the whole tree in one batch with the root at position n_past.

    Returns (logits [n_nodes, n_vocab], {layer: [n_nodes, n_embd]} taps, seq ids per node,
    number of leaf sequences); logits and taps are views of llama.cpp's buffers, valid until the
    target's next decode. A chain (one leaf) is decoded in the main sequence itself, as
    upstream's speculative-simple does; a tree's leaves i get sequence ids 1..L that see the
    prefix (seq 0) through seq_cp. The caller must `commit_tree` or `discard_tree` afterwards.
    """
    leaves = tree.leaves()
    n_seqs = len(leaves) if len(leaves) > 1 else 0
    ids, _ = tree.seq_ids(base=MAIN_SEQ + 1 if n_seqs else MAIN_SEQ)
    for s in range(1, n_seqs + 1):
        target.copy_seq(MAIN_SEQ, s, 0, n_past)
    if n_seqs:
        ids[0] = [MAIN_SEQ] + ids[0]  # the root is committed whatever is accepted
    depths = tree.depths()
    target.decode(tree.tokens, [n_past + d for d in depths], ids, [True] * len(tree))
    logits = target.logits_rows(len(tree))
    feats = {lid: target.tap(lid, copy=False) for lid in taps}  # the step reads them before the next decode
    return logits, feats, ids, n_seqs


def commit_tree(target, ids: list[list[int]], n_seqs: int, n_past: int, verdict: Verdict) -> None:
    """Keep root + accepted path in the main sequence and drop every other tree cell. A chain
    only trims its rejected tail; a tree's accepted cells are packed next to the root, so the
    cache is laid out exactly as a chain's."""
    if not n_seqs:
        if len(verdict.accepted) + 1 < len(ids):  # a rejected tail (a plain step or a full accept has none)
            target.remove(MAIN_SEQ, n_past + 1 + len(verdict.accepted), -1)
        return
    if verdict.accepted:
        winner = ids[verdict.accepted[-1]][0]  # a leaf id below the last accepted node
        target.copy_seq(winner, MAIN_SEQ, n_past + 1, n_past + 1 + len(verdict.accepted))
    for s in range(1, n_seqs + 1):
        target.remove(s, -1, -1)
    if verdict.accepted:
        target.pack_tail(MAIN_SEQ, n_past + 1)


def discard_tree(target, n_seqs: int, n_past: int) -> None:
    for s in range(1, n_seqs + 1):
        target.remove(s, -1, -1)
    target.remove(MAIN_SEQ, n_past, -1)


def draft_by_policy(d, policy, history, sampler) -> tuple[DraftTree, bool]:
    """--block-size auto's draft (runtime/engine/policy.py) and whether a drafter ran. A lookup
    (`d.lookup`: the n-gram drafter itself, or the one in front of a model drafter) costs next to
    nothing, so it runs first and the policy cuts its continuation to the depth that pays for its
    match's kind; without a match the policy decides the model drafter's depth before it runs
    (0: a plain step, the drafter's cost saved)."""
    lookup = getattr(d, "lookup", None)
    if lookup is not None:
        tree = lookup.propose(history)
        if len(tree) > 1:
            return tree.prefix(policy.depth(tree.kind, len(tree) - 1, tree.prior) + 1), True
    model = d.model if lookup is not None else d
    depth = policy.depth() if model is not None else 0
    if depth == 0:
        return DraftTree([history[-1]], [-1]), False  # the drafter does not pay now: a plain step
    return model.propose(history, sampler).prefix(depth + 1), True  # a chain: root + depth drafted tokens


def speculative_steps(s) -> Iterator[list[int]]:
    """Step function for generate_stream (StepState `s` carries target and drafter)."""
    t, d = s.target, s.drafter
    bonus = sample(s.logits, s.sampling, s.rng, s.tokens)  # the prefill pass's token
    s.stats.record_pass(0)
    yield [bonus]
    policy = getattr(d, "policy", None)  # runtime/engine/policy.py: --block-size auto (chains)
    adapter = getattr(d, "adapter", None)  # runtime/engine/adapt.py: --adapt's rejection signal
    sampler = DraftSampler(s.sampling, s.rng) if acceptance_rule(s.sampling, d) == "rejection" else None
    while True:
        n_past = len(s.tokens) - 1  # the cache holds tokens[:-1]; the root is tokens[-1]
        t0 = time.perf_counter()
        if policy is None:
            tree, ran = d.propose(s.tokens, sampler), True
        else:
            tree, ran = draft_by_policy(d, policy, s.tokens, sampler)
        t1 = time.perf_counter()
        s.stats.draft_s += t1 - t0
        # a batch larger than the target's exact limit would round differently from plain
        # decoding (Target.exact_batch_limit); keep the tree's first nodes instead
        # every node takes a KV cell: near the end of the context keep the nodes that fit (at
        # least the root, which generate_stream's budget guarantees a cell)
        tree = tree.prefix(min(len(tree), t.exact_batch_limit, t.config.n_batch, t.n_ctx - n_past))
        n_seqs = len(tree.leaves())  # an upper bound until verify_tree says (a chain uses none)
        committed = False
        try:
            logits, feats, ids, n_seqs = verify_tree(t, tree, n_past, d.target_layers)
            verdict = accept(tree, logits, s.sampling, s.rng, s.tokens)
            commit_tree(t, ids, n_seqs, n_past, verdict)
            committed = True
        finally:
            if not committed:
                discard_tree(t, n_seqs, n_past)
        t2 = time.perf_counter()
        s.stats.verify_s += t2 - t1
        if policy is not None:
            policy.record(len(tree) - 1, len(verdict.accepted), t2 - t1, t1 - t0 if ran and tree.kind is None else None,
                          len(tree), tree.kind)
        rows = [0, *verdict.accepted]
        d.observe([tree.tokens[i] for i in rows], n_past, {lid: f[rows] for lid, f in feats.items()} or None)
        s.stats.draft_s += time.perf_counter() - t2  # the drafter's own pass over the committed rows
        if adapter is not None:  # timed by the adapter itself (stats.adapt["signal_s"])
            adapter.record_block(tree, logits, verdict)
        s.stats.record_pass(len(verdict.accepted))
        s.stats.drafted += len(tree) - 1
        yield [tree.tokens[i] for i in verdict.accepted] + [verdict.token]
