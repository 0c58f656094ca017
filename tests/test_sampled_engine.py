"""Sampled speculative decoding on the real model follows the target's distribution:
the joint law of the first two generated tokens, chain and tree, at two temperatures,
against the exact law computed from the target's own logits (chi-square)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy import stats as sps

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams, target_distribution
from blockspec.runtime.llama.target import Target, TargetConfig
from blockspec.runtime.drafters.tree import DraftTree

N_RUNS = 300


class PathsDrafter(Drafter):
    """Proposes fixed paths after the prompt (deterministic drafts: sample-and-match)."""

    name = "paths"

    def __init__(self, paths, n_prompt):
        self.paths, self.n_prompt = paths, n_prompt
        self.max_nodes, self.max_leaves = 8, 4

    def propose(self, history, sampler=None):
        if len(history) == self.n_prompt + 1:  # root = first generated token: draft its children
            return DraftTree.from_paths(history[-1], [p[1:] for p in self.paths if p[0] == history[-1]])
        return DraftTree([history[-1]], [-1])


@pytest.fixture(scope="module")
def setup(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=512, n_seq_max=8)) as t:
        prompt = prompt_tokens(t, "Name a colour.")
        yield t, prompt


def _exact_joint(t, prompt, params):
    t.clear()
    p1 = target_distribution(t.prefill(prompt), params, prompt)
    joint = {}
    for x1 in np.nonzero(p1)[0]:
        t.clear()
        p2 = target_distribution(t.prefill(prompt + [int(x1)]), params, prompt + [int(x1)])
        for x2 in np.nonzero(p2)[0]:
            joint[(int(x1), int(x2))] = p1[x1] * p2[x2]
    return joint, p1


@pytest.mark.parametrize("temperature", [0.7, 1.5])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampled_speculative_matches_target_law(setup, shape, temperature):
    t, prompt = setup
    params = SamplingParams(temperature=temperature, top_k=3, top_p=1.0, min_p=0.0)
    joint, p1 = _exact_joint(t, prompt, params)
    # drafts: the likely continuations of each likely first token (the second and third
    # tokens' drafts are what acceptance judges; the first comes from the prefill)
    likely = sorted(joint, key=joint.get, reverse=True)
    paths = [list(k) for k in likely[: (1 if shape == "chain" else 4)]]
    counts: dict[tuple[int, int], int] = {}
    t.clear()
    for seed in range(N_RUNS):
        sp = SamplingParams(temperature=temperature, top_k=3, top_p=1.0, min_p=0.0, seed=seed)
        gen = generate(t, prompt, max_tokens=2, sampling=sp, drafter=PathsDrafter(paths, len(prompt)))
        key = tuple(gen.tokens[:2])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(joint), "sampled a pair outside the target's support"
    keys = sorted(joint)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([joint[k] for k in keys]) * N_RUNS
    big = exp >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    keep = exp > 0
    pvalue = sps.chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue
    assert pvalue > 1e-4, (pvalue, dict(zip(keys, obs)), dict(zip(keys, exp)))


def _exact_joint3(t, prompt, params):
    """Exact law of the first three generated tokens (the target's own logits at every prefix)."""
    joint2, _ = _exact_joint(t, prompt, params)
    joint = {}
    for (x1, x2), pr in joint2.items():
        t.clear()
        hist = prompt + [x1, x2]
        p3 = target_distribution(t.prefill(hist), params, hist)
        for x3 in np.nonzero(p3)[0]:
            joint[(x1, x2, int(x3))] = pr * p3[x3]
    return joint


def _chi2_pvalue(counts: dict, joint: dict) -> float:
    keys = sorted(joint)
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    exp = np.array([joint[k] for k in keys]) * sum(counts.values())
    big = exp >= 5  # pool rare cells so the chi-square approximation holds
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    keep = exp > 0
    return sps.chisquare(obs[keep], exp[keep] * obs.sum() / exp[keep].sum()).pvalue


N_REJECTION_RUNS = 300
N_CONFIRM_RUNS = 3000  # fresh seeds, run only when the first 300 look off: see below


@pytest.mark.parametrize("temperature,repeat_penalty", [(0.7, 1.0), (1.5, 1.0), (1.0, 1.3)])
@pytest.mark.parametrize("branches", [1, 2], ids=["chain", "tree"])
def test_rejection_sampling_with_drafter_q_matches_target_law(setup, branches, temperature, repeat_penalty):
    """The shipped SpecBlock (ggml) drafts from its own distribution and the engine accepts by
    recursive rejection sampling: the joint law of the first three generated tokens (the second
    and third are drafted and judged) is the target's, chi-square against the exact law from the
    target's logits; drafts were accepted, and the stats name the rule.

    The seeds are fixed, so a new shipped drafter redraws every sample: at p > 1e-4 each of the
    tests that share this rule fails about once in 10^4 drafters by chance alone (the stage-11
    drafter's chain at T = 1.5 drew p = 4.4e-5 on seeds 0-299, p = 0.48 on seeds 10000-15999). A
    first look that fails is therefore judged again on N_CONFIRM_RUNS fresh seeds, alone: a real
    bias the 300 runs could see shows there with ten times the power."""
    from blockspec.runtime.engine.setup import make_drafter, shipped_drafter

    t, prompt = setup
    params = SamplingParams(temperature=temperature, top_k=3, top_p=1.0, min_p=0.0, repeat_penalty=repeat_penalty)
    joint = _exact_joint3(t, prompt, params)
    d = make_drafter("specblock", shipped_drafter("specblock"), "ggml", block_size=4, branches=branches)

    def law(seeds):
        counts: dict[tuple, int] = {}
        accepted, outside = 0, []
        t.clear()
        for seed in seeds:
            gen = generate(t, prompt, max_tokens=3, sampling=dataclasses.replace(params, seed=seed), drafter=d)
            assert gen.stats.acceptance == "rejection"
            accepted += sum(k * n for k, n in enumerate(gen.stats.accept_hist))
            key = tuple(gen.tokens[:3])
            counts[key] = counts.get(key, 0) + 1
            if key not in joint:  # name the seed, so the run can be replayed alone
                outside.append((seed, key, gen.finish_reason, gen.stats.accept_hist))
        assert not outside, f"sampled triples outside the target's support (seed, triple, finish, accepted): {outside[:5]}"
        return _chi2_pvalue(counts, joint), accepted

    pvalue, accepted = law(range(N_REJECTION_RUNS))
    assert accepted >= N_REJECTION_RUNS // 10, f"only {accepted} drafted tokens accepted in {N_REJECTION_RUNS} runs"
    if pvalue <= 1e-4:
        pvalue, _ = law(range(N_REJECTION_RUNS, N_REJECTION_RUNS + N_CONFIRM_RUNS))
    assert pvalue > 1e-4, pvalue


@pytest.mark.parametrize("backend", ["ggml", "torch"])
@pytest.mark.parametrize("method,branches", [("specblock", 1), ("specblock", 2), ("dblast", 1), ("dblast", 2)])
def test_drafters_sample_from_their_own_laws(setup, method, branches, backend):
    """Every block drafter, both backends, chains and trees: at T > 0 each drafted node carries the
    law it was drawn from (a law over target ids, ascending, giving its token mass), and
    generation runs with the rejection rule."""
    from blockspec.runtime.engine.sampling import DraftSampler
    from blockspec.runtime.engine.setup import make_drafter, shipped_drafter

    t, prompt = setup
    d = make_drafter(method, shipped_drafter(method), backend, block_size=4, branches=branches)
    params = SamplingParams(temperature=0.8, seed=1)
    t.clear()
    gen = generate(t, prompt, max_tokens=12, sampling=params, drafter=d)
    # the sampled answer may end early (EOS), depending on what the drafter drew
    assert gen.stats.acceptance == "rejection" and 1 <= len(gen.tokens) <= 12
    assert gen.finish_reason == "stop" or len(gen.tokens) == 12
    tree = d.propose(prompt + gen.tokens, DraftSampler(params, np.random.default_rng(0)))
    assert len(tree) > 1 and tree.q[0] is None
    for tok, law in zip(tree.tokens[1:], tree.q[1:]):
        assert (np.diff(law.ids) > 0).all() and 0 <= law.ids[0] and law.ids[-1] < t.n_vocab
        assert abs(law.probs.sum() - 1) < 1e-9 and law[tok] > 0
    d.trim(0)
