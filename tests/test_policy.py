"""`--block-size auto` (runtime/engine/policy.py): the depth choice from measured costs, and that the engine
driven by it stays lossless (greedy output == plain) whatever it chooses."""

from __future__ import annotations

import pytest

from blockspec.runtime.engine.setup import make_drafter, parse_block_size
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.engine.policy import DepthPolicy
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.llama.target import Target, TargetConfig

from prompts import PROMPTS


def simulate(policy: DepthPolicy, verify, draft: float, accept_prob: float, steps: int = 300) -> list[int]:
    """Drive the policy with a synthetic machine: a pass over n rows costs verify(n) seconds, a
    draft `draft` seconds, and each drafted token is accepted with `accept_prob` while the
    previous ones were (a seeded generator)."""
    import random

    rng = random.Random(0)
    for _ in range(steps):
        k = policy.depth()
        accepted = 0
        while accepted < k and rng.random() < accept_prob:
            accepted += 1
        policy.record(k, accepted, verify(k + 1), draft if k else None, k + 1)
    return policy.depths


def test_falls_back_to_plain_when_drafts_do_not_pay():
    # this CPU's curve (2.1x for 4 rows) and a drafter accepting 30% of its tokens
    depths = simulate(DepthPolicy(4), lambda n: 0.014 * (1 + 0.37 * (n - 1)), 0.004, 0.3)
    tail = depths[100:]
    assert tail.count(0) / len(tail) > 0.9  # mostly plain steps ...
    assert 1 in tail  # ... with a one-token probe now and then, ever rarer while plain keeps winning
    probes = [i for i, k in enumerate(depths) if i >= 20 and k == 1]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps and gaps[-1] > gaps[0]


def test_probes_find_a_drafter_that_starts_to_pay():
    """The text turns predictable after 150 plain-winning steps: the probes see it and the policy
    drafts again."""
    import random

    rng = random.Random(0)
    p = DepthPolicy(4)
    cost = lambda n: 0.014 * (1 + 0.37 * (n - 1))  # noqa: E731
    for step in range(400):
        k = p.depth()
        acc_p = 0.1 if step < 150 else 0.95
        accepted = 0
        while accepted < k and rng.random() < acc_p:
            accepted += 1
        p.record(k, accepted, cost(k + 1), 0.002 if k else None, k + 1)
    assert p.depths[100:150].count(0) > 40 and sum(p.depths[-100:]) / 100 > 2


def test_drafts_deep_when_verification_is_nearly_free():
    # a GPU-like curve (16 rows cost about one) and a good drafter
    depths = simulate(DepthPolicy(8), lambda n: 0.010 * (1 + 0.02 * (n - 1)), 0.001, 0.8)
    assert sum(depths[50:]) / len(depths[50:]) > 6


def test_picks_an_intermediate_depth():
    # acceptance decays with depth: expected tokens flatten while the cost keeps growing
    p = DepthPolicy(6)
    p.verify_s = {n: 0.010 * (1 + 0.25 * (n - 1)) for n in range(1, 8)}
    p.verify_n = {n: 10 for n in p.verify_s}
    p.draft_s = 0.001
    for j, q in enumerate([0.9, 0.7, 0.4, 0.2, 0.1, 0.05], start=1):  # conditional acceptance per depth
        p.tries[j], p.hits[j] = 1000.0, 1000.0 * q
    rates = [p.expected_rate(k) for k in range(7)]
    assert 0 < p.depth() < 6 and p.depths[-1] == max(range(7), key=rates.__getitem__)


def test_lookup_kinds_are_estimated_apart():
    """A lookup's long matches (kind 32, 95% accepted) and short ones (kind 3, 30%) on this CPU's
    curve: the policy drafts the long ones deep and takes plain steps on the short ones."""
    import random

    rng = random.Random(0)
    p = DepthPolicy(4)
    cost = lambda n: 0.014 * (1 + 0.37 * (n - 1))  # noqa: E731
    chosen: dict[int, list[int]] = {3: [], 32: []}
    for step in range(400):
        kind = 32 if step % 2 else 3
        k = p.depth(kind, 8, prior=(kind - 1) / kind)
        accepted = 0
        while accepted < k and rng.random() < (0.95 if kind == 32 else 0.3):
            accepted += 1
        p.record(k, accepted, cost(k + 1), None, k + 1, kind)
        chosen[kind].append(k)
    assert sum(chosen[32][50:]) / len(chosen[32][50:]) > 5
    assert chosen[3][50:].count(0) / len(chosen[3][50:]) > 0.8
    assert p.draft_s is None and p.tries[1] == 0  # the model drafter's estimate untouched


def test_ngram_continues_the_longest_match():
    """Of two earlier occurrences of the last 3 tokens, the older one that agrees 6 tokens back is
    continued (not the latest, which agrees only on the 3), and the tree names its class."""
    from blockspec.runtime.drafters.ngram import MATCH_CLASSES, NgramDrafter

    long_ctx = [10, 11, 12, 1, 2, 3, 50, 51]   # ... 10 11 12 | 1 2 3 -> 50 51
    short_ctx = [77, 1, 2, 3, 60, 61]          # 77 | 1 2 3 -> 60 61
    history = [5, *long_ctx, 6, *short_ctx, 7, 10, 11, 12, 1, 2, 3]
    tree = NgramDrafter(block_size=2).propose(history)
    assert tree.tokens[1:] == [50, 51]
    assert tree.kind == max(c for c in MATCH_CLASSES if c <= 6) and 0 < tree.prior < 1
    assert NgramDrafter(block_size=2).propose([1, 2, 3, 4]).kind is None  # no match: a plain step


def test_ngram_index_follows_the_history_it_is_given():
    """The lookup indexes the history it last saw and extends that index as a generation appends;
    a history that is not an extension (another request, a rewound one) is looked up afresh: every
    proposal equals a fresh drafter's on the same history."""
    import random

    from blockspec.runtime.drafters.ngram import NgramDrafter

    rng = random.Random(0)
    kept = NgramDrafter(block_size=3, branches=2, min_ngram=2, max_ngram=3)
    history = [rng.randrange(6) for _ in range(5)]
    for step in range(400):
        if step % 50 == 49:
            cut = rng.randint(1, len(history) - 1)  # another history, longer but not an extension
            history = history[:cut] + [(history[cut] + 1) % 6] + [rng.randrange(6) for _ in range(len(history) - cut)]
        fresh = NgramDrafter(block_size=3, branches=2, min_ngram=2, max_ngram=3).propose(history)
        got = kept.propose(history)
        assert (got.tokens, got.parents, got.kind) == (fresh.tokens, fresh.parents, fresh.kind)
        history = history + [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_a_slow_first_plain_pass_does_not_stick():
    """The first plain step after a prefill ran 30x slow: the estimate keeps the faster second one,
    so a drafter that does not pay still falls back to plain steps."""
    p = DepthPolicy(4)
    cost = lambda n: 0.014 * (1 + 0.37 * (n - 1))  # noqa: E731
    first = True
    for _ in range(60):
        k = p.depth()
        t = cost(k + 1) * (30 if k == 0 and first else 1)
        first = first and k != 0
        p.record(k, 0, t, 0.004 if k else None, k + 1)  # nothing is ever accepted
    assert p.verify_s[1] == pytest.approx(cost(1)) and p.depths[-20:].count(0) > 15


def test_verify_cost_interpolates_measured_sizes():
    p = DepthPolicy(4)
    assert p.verify_cost(3) is None
    p.record(0, 0, 1.0, None, 1)
    assert p.verify_cost(3) == pytest.approx(3.0)  # one size: proportional
    p.record(4, 0, 5.0, 0.1, 5)
    assert p.verify_cost(3) == pytest.approx(3.0) and p.verify_cost(7) == pytest.approx(7.0)


def test_block_size_values():
    assert parse_block_size("auto") == "auto" and parse_block_size("3") == 3 and parse_block_size(5) == 5
    for bad in ("0", "-2", "many"):
        with pytest.raises(BlockspecError, match="--block-size"):
            parse_block_size(bad)
    with pytest.raises(BlockspecError, match="--branches 1"):
        make_drafter("ngram", block_size="auto", branches=2)


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=512, n_seq_max=4)) as t:
        yield t


@pytest.mark.parametrize("method", ["ngram", "specblock"])
def test_auto_is_lossless(target, method):
    # the n-gram drafter consults the policy only where its lookup matches: a prompt the answer repeats
    prompt = prompt_tokens(target, PROMPTS[1] if method == "specblock" else
                           "Repeat this list exactly: apples, pears, plums, apples, pears, figs, apples, pears.")
    greedy = SamplingParams(temperature=0.0)
    want = generate(target, prompt, max_tokens=40, sampling=greedy).tokens
    d = make_drafter(method, block_size="auto")  # specblock: the shipped drafter
    assert d.policy.max_depth == d.block_size
    got = generate(target, prompt, max_tokens=40, sampling=greedy, drafter=d)
    assert got.tokens == want
    assert len(d.policy.depths) >= 2 and d.policy.depths[0] == d.block_size  # measured a full draft first


def test_deeper_sizes_follow_one_rows_cost():
    """A deeper size's cost is kept relative to one row's: when plain steps find one row dearer (a
    longer context), a size measured earlier is read as dearer by the same factor, not at the seconds
    of its last measurement (which had made drafts look dear after a long request, cheap after a short one)."""
    p = DepthPolicy(4)
    for _ in range(3):
        p.record(0, 0, 0.010, None, 1)
    for _ in range(3):
        p.record(1, 1, 0.0125, None, 2)
    assert p.verify_cost(2) == pytest.approx(0.0125)
    for _ in range(40):
        p.record(0, 0, 0.020, None, 1)
    assert p.verify_cost(1) == pytest.approx(0.020, rel=1e-3)
    assert p.verify_cost(2) == pytest.approx(0.025, rel=1e-3)
