"""Lossless acceptance of a verified draft tree. Pure functions: logits in, tokens out.

Terms (per target pass):
- **accepted** tokens: drafted nodes on the path from the root that the rule keeps; they
  are emitted and their KV rows are already in the target cache;
- **recovered** token: where the walk stops at a node whose children were all rejected,
  the rule emits one token drawn from what remains of the target distribution there
  (greedy: the target's argmax, which no child had);
- **bonus** token: where the walk reaches a leaf, the target's logits at that leaf give one
  more token for free.
Either way each pass emits len(accepted) + 1 tokens, and the last one becomes the next
root (it is not in the cache yet).

Rules:
- greedy (temperature <= 0): descend while some child equals the target's argmax. The
  output is token-for-token the target's greedy output.
- sampled, children chosen deterministically (q is None): *sample-and-match* — draw
  x ~ p_target at the node; descend into the child whose token is x, else emit x. The
  emitted token at every position is exactly a draw from p_target (this is what upstream
  llama.cpp does for chains, extended to trees).
- sampled, children drawn from draft distributions: *recursive rejection sampling*
  (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", for one
  child; Miao et al. 2024, SpecInfer, for several): try child c (token x, drawn from q_c) with
  probability min(1, p(x)/q_c(x)); on rejection replace p by norm(max(p - q_c, 0)) and try the
  next child; if all are rejected emit a draw from the last residual. Again exactly p.
  Why, for any siblings: q_c is the law of child c's token *given the tokens and verdicts of
  the children tried before it* (tree.q[c]). Then trying c is one step of speculative
  sampling of the current target p from proposal q_c, whose output (x if accepted, else a
  draw from the residual) has law p; by induction over the children, so has the whole walk
  at the node. This covers siblings drawn i.i.d. (q_c = q), drawn from different laws
  independently (DBlast branches), and drawn *without replacement* (q_c = q with the earlier
  siblings removed, renormalised): x_1 is only ever rejected when p(x_1) < q(x_1), so the
  residual gives x_1 no mass and never needs it again (tree.draw_without_replacement).
The target distribution p is `sampling.target_law` — the same function plain decoding
samples from, penalties and filters included — evaluated with the node's own history (the
committed tokens plus the path to it). Laws are held by their support (sampling.Law): the
dense computation's masses and draws, with its residuals to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from blockspec.runtime.engine.sampling import SamplingParams, penalize, sample, target_law
from blockspec.runtime.drafters.tree import DraftTree


@dataclass
class Verdict:
    accepted: list[int]  # node indices (root excluded) along the accepted path, in order
    token: int  # the recovered or bonus token emitted after them
    bonus: bool  # True when the walk ended at a leaf


def _node_history(tree: DraftTree, node: int, history: Sequence[int]) -> list[int]:
    # history ends with the root token; add the drafted tokens on the path to `node`
    return list(history) + [tree.tokens[i] for i in tree.path(node)[1:]]


def accept_greedy(tree: DraftTree, logits: np.ndarray, sampling: SamplingParams,
                  history: Sequence[int]) -> Verdict:
    """`logits[i]` is the target's [n_vocab] row at node i."""
    kids = tree.children()
    node, accepted = 0, []
    needs_history = sampling.repeat_penalty != 1.0
    while True:
        row = logits[node]
        if needs_history:
            row = penalize(np.asarray(row), _node_history(tree, node, history), sampling)
        best = int(np.argmax(row))
        nxt = next((c for c in kids[node] if tree.tokens[c] == best), None)
        if nxt is None:
            return Verdict(accepted, best, bonus=not kids[node])
        accepted.append(nxt)
        node = nxt


def accept_sampled(tree: DraftTree, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
                   history: Sequence[int]) -> Verdict:
    kids = tree.children()
    node, accepted = 0, []
    needs_history = sampling.repeat_penalty != 1.0
    while True:
        node_history = _node_history(tree, node, history) if needs_history else ()
        if not kids[node] or tree.q[kids[node][0]] is None:
            # a leaf's bonus, or deterministic children (sample-and-match): a token, not the law
            x = sample(logits[node], sampling, rng, node_history)
            if not kids[node]:
                return Verdict(accepted, x, bonus=True)
            nxt = next((c for c in kids[node] if tree.tokens[c] == x), None)
            if nxt is None:
                return Verdict(accepted, x, bonus=False)
        else:
            p = target_law(logits[node], sampling, node_history)
            for c in kids[node]:
                x, q = tree.tokens[c], tree.q[c]
                qx = q[x]
                if qx > 0 and rng.random() * qx < p[x]:  # accept w.p. min(1, p/q)
                    nxt = c
                    break
                if c == kids[node][-1]:  # the last child: draw from the residual itself
                    x = p.residual_draw(q, rng)
                    return Verdict(accepted, p.draw(rng) if x is None else x, bonus=False)
                residual = p.residual(q)
                if residual is None:  # p == q up to rounding: rejection had probability ~0
                    continue
                p = residual
        accepted.append(nxt)
        node = nxt


def accept(tree: DraftTree, logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator,
           history: Sequence[int]) -> Verdict:
    if sampling.greedy:
        return accept_greedy(tree, logits, sampling, history)
    return accept_sampled(tree, logits, sampling, rng, history)
