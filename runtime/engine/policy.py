"""`--block-size auto`: each step's draft depth from costs measured on this machine.

A chain drafter proposes up to K tokens; drafting k of them (k = 0: a plain step, no draft) and
verifying them costs

    cost(k) = V(k + 1) + D * [k > 0]

seconds, where V(n) is a target pass over n rows and D one draft, and yields on average

    E(k) = 1 + sum_{j=1..k} P(the first j drafted tokens are all accepted)

new tokens (the 1 is the target's own token, always produced). The policy drafts the k that
maximises E(k) / cost(k), so when the drafter does not pay (short accepted prefixes, a steep
verify-cost curve, as on a 2-core CPU) it falls back to plain steps instead of running slower.
Verification is lossless for any draft, so the choice never changes the output.

Drafts come in kinds, each with its own acceptance estimate: a model drafter's (kind None), decided
before the drafter runs, so D counts; and an n-gram lookup's, keyed by the length of the match it
continues (runtime/drafters/ngram.py), decided after the lookup has run (its cost is sunk, D = 0):
a continuation of a 20-token repeat is accepted far more often than one of a 3-token match, so it
pays to draft it deeper.

Estimates, all running (they follow the text and the machine):
- V(n): exponential average of the measured pass time per n (after the fastest of its first
  SETTLE passes); for n > 1 the average is of the pass's time over V(1)'s at that moment, so V(n)
  moves with V(1), which a plain step measures and the context's length moves; an n never measured
  is read off the straight line through the nearest measured sizes (one measured size: V scales
  with n from it);
- D: exponential average of the measured draft time;
- P(>= j) = c_1 * ... * c_j, where c_i, the chance that drafted token i is accepted once tokens
  1..i-1 were, comes from counts of the steps of that kind that reached token i, decayed at
  every step of that kind (plain ones too, applied when a probe ends a plain run), plus
  one pseudo-try at the kind's prior (a model drafter: one at 1/2, unless BlockPilot
  predicted this request's acceptance after its prefill: runtime/engine/pilot.py; a lookup: the
  prior it states for its match length); a depth never reached takes the deepest estimated c (the
  drafter is assumed to keep its quality, so the policy tries deeper when the measured depths pay).
While plain steps win for a kind, a step of that kind still drafts one token now and then (a probe),
so its acceptance estimate can recover when the text becomes predictable: the `explore`-th plain step
first, then twice as many plain steps before each next probe while they keep winning (up to
MAX_EXPLORE); the plain run ages the kind's evidence first, so the probe's result counts. A probe drafts one token, not the full depth: on this CPU a full-depth probe every 8th
step (a 5-row pass, 3.5 plain tokens, for ~0.7 accepted) cost SpecBlock's auto ~20% of its speed.
"""

from __future__ import annotations

from typing import Hashable

DECAY = 0.97      # per-step decay of a kind's acceptance counts (~30 steps of memory)
ALPHA = 0.2       # weight of a new measurement in the time averages
# a batch size's first passes run slow (llama.cpp sizes its compute buffers for a new batch shape,
# the first plain step follows the prefill): the estimate starts from the fastest of the first
# SETTLE passes, and the warm-up takes SETTLE plain steps. One slow first plain step (868 ms against
# ~250 for 9 rows, on a loaded machine) had otherwise made plain look dear for the whole request,
# never to be measured again while drafting won.
SETTLE = 2
EXPLORE = 8       # while k = 0 wins, probe with one drafted token after EXPLORE plain steps ...
MAX_EXPLORE = 128  # ... then after twice as many each time, up to this many


def _settled(avg: float | None, x: float, n: int) -> float:
    """The running estimate after its n-th measurement x: the fastest of the first SETTLE, then an
    exponential average (see SETTLE)."""
    if avg is None:
        return x
    return min(avg, x) if n <= SETTLE else (1 - ALPHA) * avg + ALPHA * x


class _Acceptance:
    """Decayed acceptance counts of one kind of draft, per depth."""

    def __init__(self, depth: int, prior: float, explore: int = EXPLORE):
        self.prior = prior
        self.tries = [0.0] * (depth + 1)  # [j]: decayed steps that reached drafted token j
        self.hits = [0.0] * (depth + 1)   # [j]: ... and accepted it
        self.plain_run = 0  # plain steps since the last draft
        self.explore_after = explore  # plain steps before the next probe

    def grow(self, depth: int) -> None:
        extra = depth + 1 - len(self.tries)
        if extra > 0:
            self.tries += [0.0] * extra
            self.hits += [0.0] * extra

    def p_accept(self, j: int) -> float:
        """P(the first j drafted tokens are all accepted)."""
        p, c = 1.0, self.prior
        for i in range(1, j + 1):
            if i < len(self.tries) and self.tries[i] > 0:
                c = (self.hits[i] + self.prior) / (self.tries[i] + 1.0)
            p *= c
        return p

    def fade(self, steps: int = 1) -> None:
        """`steps` steps of this kind passed: older evidence weighs less (~30 steps of memory).
        Plain steps age it too, all at once when a probe ends a run of them: between probes the
        estimate, and so the choice of plain, stays put."""
        f = DECAY ** steps
        for j in range(1, len(self.tries)):
            self.tries[j] *= f
            self.hits[j] *= f

    def record(self, drafted: int, accepted: int) -> None:
        self.grow(drafted)
        self.fade()
        for j in range(1, min(drafted, accepted + 1) + 1):  # tokens the target got to judge
            self.tries[j] += 1.0
            self.hits[j] += 1.0 if accepted >= j else 0.0


class DepthPolicy:
    def __init__(self, max_depth: int, explore: int = EXPLORE):
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth             # a model drafter's deepest draft
        self.explore = explore
        self.verify_s: dict[int, float] = {}   # rows -> average seconds of a target pass
        self.verify_n: dict[int, int] = {}     # rows -> passes measured
        # rows > 1 -> average of a pass's seconds over V(1)'s when it was measured: V(1) is measured nearly every
        # step and follows the context's length, a deeper size only when drafted; kept as ratios, V(n) =
        # ratio * V(1) moves with V(1) instead of keeping the context of its last measurement
        self.ratio: dict[int, float] = {}
        self.ratio_n: dict[int, int] = {}
        self.draft_s: float | None = None
        # kind -> estimate; None: the model drafter's (prior 1/2, one pseudo-try; BlockPilot sets it)
        self.kinds: dict[Hashable, _Acceptance] = {None: _Acceptance(max_depth, 0.5, explore)}
        self.depths: list[int] = []            # the depth chosen at each step (for stats and tests)

    # the model drafter's estimate (kind None), as BlockPilot and the tests address it
    @property
    def prior(self) -> float:
        return self.kinds[None].prior

    @prior.setter
    def prior(self, c: float) -> None:
        self.kinds[None].prior = c

    @property
    def tries(self) -> list[float]:
        return self.kinds[None].tries

    @property
    def hits(self) -> list[float]:
        return self.kinds[None].hits

    # ------------------------------------------------------------------ estimates
    def p_accept(self, j: int, kind: Hashable = None) -> float:
        """P(the first j drafted tokens of a `kind` draft are all accepted)."""
        return self.kinds[kind].p_accept(j)

    def verify_cost(self, n: int) -> float | None:
        """Estimated seconds of a target pass over n rows (None before any measurement)."""
        if n in self.verify_s:
            return self.verify_s[n]
        if not self.verify_s:
            return None
        sizes = sorted(self.verify_s)
        lo = max((m for m in sizes if m < n), default=None)
        hi = min((m for m in sizes if m > n), default=None)
        if lo is not None and hi is not None:  # between two measured sizes: the line through them
            f = (n - lo) / (hi - lo)
            return self.verify_s[lo] + f * (self.verify_s[hi] - self.verify_s[lo])
        if len(sizes) >= 2:  # outside: the line through the two nearest
            a, b = (sizes[-2], sizes[-1]) if hi is None else (sizes[0], sizes[1])
            slope = (self.verify_s[b] - self.verify_s[a]) / (b - a)
            return max(self.verify_s[a] + slope * (n - a), 1e-9)
        m = sizes[0]
        return self.verify_s[m] * n / m

    def expected_rate(self, k: int, kind: Hashable = None) -> float | None:
        """Estimated new tokens per second when drafting k tokens of a `kind` draft (None: costs not
        measured yet). A model draft (kind None) pays D; a lookup's is already made."""
        v = self.verify_cost(k + 1)
        draft = self.draft_s if (kind is None and k > 0) else 0.0
        if v is None or draft is None:
            return None
        tokens = 1.0 + sum(self.p_accept(j, kind) for j in range(1, k + 1))
        return tokens / (v + draft)

    # ------------------------------------------------------------------ decisions
    def depth(self, kind: Hashable = None, available: int | None = None, prior: float = 0.5) -> int:
        """Draft depth for the next step: a model drafter's (kind None, before it runs), or how
        many of a lookup's `available` drafted tokens to verify (a new kind starts from one
        pseudo-try at `prior`)."""
        top = self.max_depth if available is None else available
        est = self.kinds.get(kind)
        if est is None:
            est = self.kinds[kind] = _Acceptance(top, prior, self.explore)
        est.grow(top)
        k = self._choose(kind, top)
        if k == 0 and top > 0:
            est.plain_run += 1
            if est.plain_run >= est.explore_after:  # a one-token probe; the next comes later
                est.fade(est.plain_run)  # the evidence aged over the plain steps: the probe counts
                est.plain_run, k = 0, 1
                est.explore_after = min(2 * est.explore_after, MAX_EXPLORE)
        else:
            est.plain_run, est.explore_after = 0, self.explore
        self.depths.append(k)
        return k

    def _choose(self, kind: Hashable, top: int) -> int:
        if (kind is None and self.draft_s is None) or top + 1 not in self.verify_s:
            return top  # measure a full draft and its verify first
        if self.verify_n.get(1, 0) < SETTLE:
            return 0  # and plain steps
        rates = [self.expected_rate(k, kind) for k in range(top + 1)]
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    # ------------------------------------------------------------------ measurements
    def record(self, drafted: int, accepted: int, verify_s: float, draft_s: float | None, rows: int,
               kind: Hashable = None) -> None:
        """One step: `drafted` tokens of a `kind` draft proposed (after cuts), `accepted` of them
        taken, a target pass over `rows` rows taking `verify_s`, and the model draft taking
        `draft_s` (None: the model drafter did not run)."""
        n = self.verify_n[rows] = self.verify_n.get(rows, 0) + 1
        if rows > 1 and 1 in self.verify_s:  # relative to one row's cost now (see self.ratio)
            r = verify_s / self.verify_s[1]
            m = self.ratio_n[rows] = self.ratio_n.get(rows, 0) + 1
            self.ratio[rows] = _settled(self.ratio.get(rows), r, m)
            self.verify_s[rows] = self.ratio[rows] * self.verify_s[1]
        else:
            self.verify_s[rows] = _settled(self.verify_s.get(rows), verify_s, n)
            if rows == 1:
                for m, r in self.ratio.items():
                    self.verify_s[m] = r * self.verify_s[1]
        if draft_s is not None:
            self.draft_s = draft_s if self.draft_s is None else (1 - ALPHA) * self.draft_s + ALPHA * draft_s
        if drafted and kind in self.kinds:
            self.kinds[kind].record(drafted, accepted)
