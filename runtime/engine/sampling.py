"""The target's sampling distribution, as one pure function.

Plain decoding and every speculative acceptance rule draw from `target_law`, so "speculative
output follows the target's sampling distribution" has one meaning. A `Law` holds a distribution
by its support (a few dozen ids under top-k), so drafting and acceptance never touch a
vocabulary-sized vector.
The chain follows llama.cpp's common sampler order: repetition penalty -> top-k ->
top-p -> min-p -> temperature -> draw. (top-k/top-p/min-p therefore act on the
untempered softmax, exactly as llama.cpp's samplers do.) temperature <= 0 is greedy:
the argmax after the penalty.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.llama.ext import blockspec_sample, blockspec_sampling_law


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

    def law(self, logits: np.ndarray) -> "Law":
        return chain_law(logits, self.params)


@dataclass(frozen=True)
class Law:
    """A distribution by its support: token ids (ascending) and their probabilities (float64).
    Every operation gives what the dense [n_vocab] vector would: masses and draws bit for bit (the
    zeros between the ids add nothing to a CDF), renormalisations to float rounding."""

    ids: np.ndarray
    probs: np.ndarray

    @classmethod
    def of(cls, probs: np.ndarray) -> "Law":
        """From a dense vector of probabilities."""
        probs = np.asarray(probs, dtype=np.float64)
        ids = np.flatnonzero(probs)
        return cls(ids, probs[ids])

    def at(self, ids: np.ndarray) -> np.ndarray:
        """Masses of tokens `ids` (0 outside the support)."""
        i = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[i] == ids, self.probs[i], 0.0)

    def __getitem__(self, token: int) -> float:
        if len(self.ids) <= SMALL:
            ids = self.ids.tolist()
            i = bisect_left(ids, token)
            return float(self.probs[i]) if i < len(ids) and ids[i] == token else 0.0
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def dense(self, n_vocab: int) -> np.ndarray:
        out = np.zeros(n_vocab)
        out[self.ids] = self.probs
        return out

    def normalized(self) -> "Law | None":
        """Rescaled to mass 1, zeros dropped; None when no mass is left."""
        keep = self.probs > 0
        total = self.probs.sum()
        return Law(self.ids[keep], self.probs[keep] / total) if total > 0 else None

    def residual(self, q: "Law") -> "Law | None":
        """norm(max(self - q, 0)): what is left of this law after a draft from q was rejected."""
        return Law(self.ids, np.maximum(self.probs - q.at(self.ids), 0.0)).normalized()

    def residual_draw(self, q: "Law", rng: np.random.Generator) -> int | None:
        """= self.residual(q).draw(rng) in one pass (None, drawing nothing, where the residual
        has no mass): the unnormalised residual's CDF scaled by one uniform, as draw() does."""
        if len(self.ids) <= SMALL and len(q.ids) <= SMALL:
            qd = dict(zip(q.ids.tolist(), q.probs.tolist()))
            ids = self.ids.tolist()
            return _draw_cdf(ids, list(accumulate(max(p - qd.get(i, 0.0), 0.0)
                                                   for i, p in zip(ids, self.probs.tolist()))), rng)
        return _draw_cdf(self.ids, np.cumsum(np.maximum(self.probs - q.at(self.ids), 0.0)), rng)

    def remap(self, ids_map: np.ndarray) -> "Law":
        """The same law over other ids: token i becomes ids_map[i] (a draft vocabulary's d2t),
        kept ascending."""
        ids = ids_map[self.ids]
        order = np.argsort(ids)
        return Law(ids[order], self.probs[order])

    def without(self, token: int) -> "Law | None":
        """This law with `token` removed, renormalised (a draw without replacement)."""
        return Law(self.ids, np.where(self.ids == token, 0.0, self.probs)).normalized()

    def draw(self, rng: np.random.Generator) -> int:
        """One token by inverse CDF on a single uniform: = draw(self.dense(n), rng)."""
        if len(self.ids) <= SMALL:
            return _draw_cdf(self.ids.tolist(), list(accumulate(self.probs.tolist())), rng)
        return _draw_cdf(self.ids, np.cumsum(self.probs), rng)


# Right after a target decode every numpy call runs from cold caches (~10-20 us each here), so the
# laws of a sampling chain (top-k 40 by default) are walked as Python lists below this size: the
# same sums in the same order (accumulate = cumsum, left to right), so the same draws.
SMALL = 64


def _draw_cdf(ids, cdf, rng: np.random.Generator) -> int | None:
    """ids[the first i with cdf[i] > u], u uniform on [0, cdf[-1]) (None: no mass)."""
    if not cdf[-1] > 0:
        return None
    u = rng.random() * cdf[-1]
    return int(ids[min(bisect_right(cdf, u), len(ids) - 1)])


def _penalizes(p: SamplingParams, history: Sequence[int]) -> bool:
    return not (p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0)


def penalize(logits: np.ndarray, history: Sequence[int], p: SamplingParams) -> np.ndarray:
    """llama.cpp's repetition penalty over the last `repeat_last_n` tokens."""
    if not _penalizes(p, history):
        return logits
    recent = np.unique(np.asarray(history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history))
    out = logits.copy()
    sel = out[recent]
    out[recent] = np.where(sel > 0, sel / p.repeat_penalty, sel * p.repeat_penalty)
    return out


def target_distribution(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = ()) -> np.ndarray:
    """[n_vocab] float64 probabilities the target samples from (one-hot when greedy)."""
    return target_law(logits, p, history).dense(np.shape(logits)[0])


def target_law(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = ()) -> Law:
    """The law the target samples from, by its support (one token when greedy). The logits stay
    float32, as llama.cpp's samplers see them, through the penalty and top-k."""
    x = penalize(np.asarray(logits, dtype=np.float32), history, p)
    if p.greedy:
        return Law(np.array([int(np.argmax(x))]), np.ones(1))
    return chain_law(x, p)


def chain_law(logits: np.ndarray, p: SamplingParams) -> Law:
    """top-k -> top-p -> min-p -> temperature over float32 logits, in one llama.cpp call (patch
    0010, blockspec_sampling_law): exactly k candidates (all without top-k), ties at the k-th place
    broken by llama.cpp's own top-k; then over them best first, equal logits in id order, top-p and
    min-p each keep a prefix, and the tempered softmax is taken in float64. One call because right
    after a target decode every numpy call runs from cold caches: the same chain in numpy took
    ~320 us a token there."""
    x = np.ascontiguousarray(logits, dtype=np.float32)
    n = x.shape[0]
    cap = p.top_k if 0 < p.top_k < n else n
    ids, probs = np.empty(cap, np.int32), np.empty(cap, np.float64)
    m = blockspec_sampling_law(x.ctypes.data, n, p.top_k, p.top_p, p.min_p, p.temperature,
                               ids.ctypes.data, probs.ctypes.data, cap)
    if m <= 0:
        raise BlockspecError(f"sampling over {n} logits failed (top-k {p.top_k}, temperature {p.temperature})")
    return Law(ids[:m], probs[:m])


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from `probs` by inverse CDF on a single uniform (reproducible per seed)."""
    cdf = np.cumsum(probs)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), probs.shape[0] - 1))


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    """= target_law(logits, p, history).draw(rng) token for token: at T > 0 the law and the draw in
    one C call (patch 0012: the same law, the same running sums and uniform, so the same token)."""
    if p.greedy:
        return int(np.argmax(penalize(np.asarray(logits), history, p)))
    x = np.ascontiguousarray(penalize(np.asarray(logits, dtype=np.float32), history, p), dtype=np.float32)
    return _draw(x.ctypes.data, x.shape[0], p, rng)


def sample_row(target, i: int, p: SamplingParams, rng: np.random.Generator, history: Sequence[int] = ()) -> int:
    """= sample(target.logits_row(i), p, rng, history), reading the row in llama.cpp's buffer where no
    penalty applies: a plain step's token without the row's copy (~0.2 ms a token less at T = 1)."""
    if _penalizes(p, history):
        return sample(target.logits_row(i), p, rng, history)
    return _draw(target.logits_pointer(i), target.n_vocab, p, rng)


def _draw(x, n: int, p: SamplingParams, rng: np.random.Generator) -> int:
    """blockspec_sample on the float32 row at `x` (an address or a ctypes pointer); greedy draws no uniform."""
    tok = blockspec_sample(x, n, p.top_k, p.top_p, p.min_p, p.temperature, 0.0 if p.greedy else rng.random())
    if tok < 0:
        raise BlockspecError(f"sampling over {n} logits failed (top-k {p.top_k}, temperature {p.temperature})")
    return tok


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)
