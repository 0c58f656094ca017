"""The target's sampling distribution, as one pure function.

Plain decoding and every speculative acceptance rule draw from `target_distribution`,
so "speculative output follows the target's sampling distribution" has one meaning.
The chain follows llama.cpp's common sampler order: repetition penalty -> top-k ->
top-p -> min-p -> temperature -> draw. (top-k/top-p/min-p therefore act on the
untempered softmax, exactly as llama.cpp's samplers do.) temperature <= 0 is greedy:
the argmax after the penalty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.llama.topk import top_k_ids


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None
    # T > 0 with a drafter (runtime/engine/acceptance.py): "rejection" drafts from the drafter's own
    # distribution and accepts by rejection sampling; "match" keeps deterministic drafts and
    # sample-and-match, whose output equals plain decoding's for the same seed
    acceptance: str = "rejection"

    def __post_init__(self):
        if self.acceptance not in ACCEPTANCE:
            raise BlockspecError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, not {self.acceptance!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


ACCEPTANCE = ("rejection", "match")


class DraftSampler:
    """What a drafter needs to draw drafts at T > 0: the law of a draft given the drafter's logits
    (the request's sampler chain, penalty aside: top-k, top-p, min-p and temperature narrow q
    where they narrow p, so more of q's mass is where p's is) and the generator to draw with."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator):
        self.params, self.rng = params, rng

    def law(self, logits: np.ndarray) -> np.ndarray:
        return target_distribution(logits, self.params)


def penalize(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's repetition penalty over the last `repeat_last_n` tokens."""
    if p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0:
        return logits
    recent = np.unique(np.asarray(history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history))
    out = logits.copy()
    sel = out[recent]
    out[recent] = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
    return out


def target_distribution(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """[n_vocab] float64 probabilities the target samples from (one-hot when greedy). The logits
    stay float32, as llama.cpp's samplers see them, through the penalty and top-k."""
    ids, probs = target_support(logits, p, history)
    out = np.zeros(np.shape(logits)[0])
    out[ids] = probs
    return out


def target_support(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The target distribution's support: (token ids [m] ascending, their probabilities [m] float64).

    Everything after top-k works on top-k's candidates only (all tokens when top-k is off),
    kept in id order so ties break as over the whole vocabulary: a full-vocabulary sort per
    token cost ~3 ms (a sixth of a SmolLM2 token)."""
    x = penalize(np.asarray(logits, dtype=np.float32), history, p)
    n = x.shape[0]
    if p.greedy:
        return np.array([int(np.argmax(x))]), np.ones(1)
    if 0 < p.top_k < n:
        cand = np.sort(top_k_ids(x, p.top_k))  # exactly k, ties at the k-th place as llama.cpp breaks them
    else:
        cand = np.arange(n)
    xc = x[cand].astype(np.float64)
    keep = np.ones(len(cand), dtype=bool)
    if p.top_p < 1.0 or p.min_p > 0.0:
        q = np.exp(xc - xc.max())
        q /= q.sum()
        if p.top_p < 1.0:
            order = np.argsort(-q, kind="stable")
            cum = np.cumsum(q[order])
            # smallest prefix whose mass reaches top_p (always at least one token)
            cut = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            mask = np.zeros(len(cand), dtype=bool)
            mask[order[:cut]] = True
            keep &= mask
        if p.min_p > 0.0:
            keep &= q >= p.min_p * q.max()
    z = xc[keep] / p.temperature
    e = np.exp(z - z.max())
    return cand[keep], e / e.sum()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from `probs` by inverse CDF on a single uniform (reproducible per seed)."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[0] - 1))


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    """= draw(target_distribution(...), rng) token for token, over the support alone: the dense
    CDF only rises at the support's ids, and adding the zeros between them is exact."""
    if p.greedy:
        return int(np.argmax(penalize(np.asarray(logits), history, p)))
    ids, probs = target_support(logits, p, history)
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(ids[min(np.searchsorted(cdf, u, side="right"), len(ids) - 1)])


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)
