"""`specblock+ngram` / `dblast+ngram` (drafters/ngram.py LookupFirst): n-gram lookup drafts where the
history repeats, the shipped model drafter elsewhere. Both kinds of step happen on a repetitive
prompt, the model drafter still sees every committed row, and greedy output equals plain decoding."""

from __future__ import annotations

import pytest

from blockspec.runtime.engine.generate import generate
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.engine.setup import make_drafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.llama.target import Target, TargetConfig

# the answer copies the prompt's code, so the lookup finds its trigrams there; where it does not (the
# renamed functions, the start) the model drafts. Measured with the stage-5 SpecBlock / stage-4 DBlast:
# the lookup drafted 5 of 12 / 6 of 14 steps. (A numbers list, used before, repeats no trigram at the
# steps a better drafter stops at.)
REPEAT = "Repeat this code exactly:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_seq_max=8)) as t:
        yield t


@pytest.mark.parametrize("method", ["specblock+ngram", "dblast+ngram"])
def test_lookup_first_is_lossless_and_uses_both(target, method):
    d = make_drafter(method, block_size=4)
    prompt = prompt_tokens(target, REPEAT)
    plain = generate(target, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0))
    spec = generate(target, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0), drafter=d)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == method
    assert d.lookup_steps > 0, "the lookup never drafted on a prompt that repeats itself"
    assert d.lookup_steps < spec.stats.target_passes - 1, "the model drafter never drafted"  # - the prefill
    assert len(d.model.tokens) == len(prompt) + len(spec.tokens) - 1  # it held every committed row


def test_lookup_first_with_a_model_tree_is_lossless(smollm2_path):
    """`specblock+ngram-tree` (the bench's): the lookup's chain where the history repeats, else
    SpecBlock's rank-head tree of up to 4 x 4 nodes, each leaf a sequence of its own."""
    d = make_drafter("specblock+ngram", block_size=4, branches=4)
    assert d.max_leaves > 1 and d.model.tree
    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_seq_max=1 + d.max_leaves)) as t:
        prompt = prompt_tokens(t, REPEAT)
        plain = generate(t, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0))
        spec = generate(t, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0), drafter=d)
    assert spec.tokens == plain.tokens
    assert 0 < d.lookup_steps < spec.stats.target_passes - 1


def test_lookup_first_sampled_follows_target_law(target):
    """T > 0: steps drafted by the lookup (deterministic, sample-and-match) and by SpecBlock (drawn
    from its own law, rejection sampling) in one generation. On a prompt that repeats, the first
    three tokens' joint law is the target's (chi-square against the exact law), and both kinds of
    step drafted within those three tokens."""
    import dataclasses

    from test_sampled_engine import _chi2_pvalue, _exact_joint3

    # the first token picks the kind of step: " B" repeats a trigram (lookup drafts), " C" or " A" do not
    # (SpecBlock drafts); measured: the target gives " B" 0.43 of its top-3 mass at T = 1
    prompt = prompt_tokens(target, "A B A C A B A C A", raw=True)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    joint = _exact_joint3(target, prompt, params)
    d = make_drafter("specblock+ngram", block_size=3)
    counts: dict[tuple, int] = {}
    model_steps = 0
    target.clear()
    n_runs = 300
    for seed in range(n_runs):
        before = d.lookup_steps
        gen = generate(target, prompt, max_tokens=3, sampling=dataclasses.replace(params, seed=seed), drafter=d)
        model_steps += gen.stats.target_passes - 1 - (d.lookup_steps - before)
        counts[tuple(gen.tokens[:3])] = counts.get(tuple(gen.tokens[:3]), 0) + 1
    assert set(counts) <= set(joint), "sampled a triple outside the target's support"
    assert d.lookup_steps > n_runs // 20 and model_steps > n_runs // 20, (d.lookup_steps, model_steps)
    assert _chi2_pvalue(counts, joint) > 1e-4


def test_bad_combined_methods_fail_in_one_line():
    with pytest.raises(BlockspecError, match="specblock\\+ngram or dblast\\+ngram"):
        make_drafter("ngram+ngram")


def test_lookup_first_auto_is_lossless(target):
    """--block-size auto with the lookup in front: the lookup's matches are estimated as kinds of
    their own beside the model drafter's, and the output is still plain decoding's."""
    d = make_drafter("specblock+ngram", block_size="auto")
    prompt = prompt_tokens(target, REPEAT)
    plain = generate(target, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0))
    spec = generate(target, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0), drafter=d)
    assert spec.tokens == plain.tokens
    assert d.lookup_steps > 0
    assert None in d.policy.kinds and len(d.policy.kinds) > 1, d.policy.kinds  # the model's and a lookup's
    assert len(d.model.tokens) == len(prompt) + len(spec.tokens) - 1


@pytest.mark.parametrize("arch", ["specblock", "dblast"])
def test_a_drafter_without_a_method_gets_the_lookup_in_front_at_auto(arch):
    """`--drafter X` and no `--method`: X's method with the lookup in front, its depth per step
    (engine.setup.default_method), greedy output plain decoding's; with --adapt the drafter alone."""
    from blockspec.runtime.engine.setup import default_method, shipped_drafter
    from blockspec.runtime.frontends.api import run_generate

    path = shipped_drafter(arch)
    assert default_method(None, path) == f"{arch}+ngram"
    assert default_method(None, path, adapt=True) == arch
    assert make_drafter(f"{arch}+ngram", path).policy is not None  # --block-size auto by default
    got = run_generate(REPEAT, drafter=path, max_tokens=48)
    want = run_generate(REPEAT, method="plain", max_tokens=48)
    assert got.stats.method == f"{arch}+ngram" and got.tokens == want.tokens
