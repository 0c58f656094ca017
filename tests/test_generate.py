"""Plain generation through our runtime equals llama-cpp-python's own greedy output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blockspec.runtime.engine.generate import generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams, make_rng, target_distribution, target_law

from conftest import run_cli

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about autumn leaves.",
    "List three uses of a paperclip.",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_greedy_equals_llama_cpp_python(smollm2, smollm2_path, prompt):
    from llama_cpp import Llama

    tokens = prompt_tokens(smollm2, prompt)
    ours = generate(smollm2, tokens, max_tokens=48, sampling=SamplingParams(temperature=0.0))
    assert ours.stats.tau == 1.0 and ours.stats.target_passes in (ours.n_tokens, ours.n_tokens + 1)

    llm = Llama(model_path=str(smollm2_path), n_ctx=2048, n_batch=512, verbose=False, flash_attn=True)
    try:
        theirs = []
        for tok in llm.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            if llm.token_eos() == tok or tok in (smollm2.eos,) or smollm2.is_eog(tok):
                break
            theirs.append(tok)
            if len(theirs) == 48:
                break
    finally:
        llm.close()
    assert ours.tokens == theirs


def test_sampling_is_reproducible_and_respects_filters(smollm2):
    tokens = prompt_tokens(smollm2, PROMPTS[1])
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    a = generate(smollm2, tokens, max_tokens=24, sampling=p)
    b = generate(smollm2, tokens, max_tokens=24, sampling=p)
    assert a.tokens == b.tokens
    # every sampled token lies in the support of the distribution it was drawn from
    smollm2.clear()
    logits = smollm2.prefill(tokens)
    probs = target_distribution(logits, p, tokens)
    assert probs[a.tokens[0]] > 0
    assert (probs > 0).sum() <= 20


@pytest.mark.parametrize("params", [dict(temperature=1.0, seed=7), dict(temperature=0.0),
                                    dict(temperature=0.9, repeat_penalty=1.2, seed=3)])
def test_plain_steps_draw_what_the_law_draws(smollm2, params):
    """Plain steps sample the target's output row where llama.cpp holds it (sampling.sample_row, one
    C call); a loop that copies each row and draws from its law with the same seed gets the same
    tokens (the penalised case goes through the copy)."""
    p = SamplingParams(**params)
    tokens = prompt_tokens(smollm2, PROMPTS[2])
    ours = generate(smollm2, tokens, max_tokens=32, sampling=p)
    smollm2.clear()
    rng, hist, ref = make_rng(p.seed), list(tokens), []
    logits = smollm2.prefill(tokens)
    while len(ref) < len(ours.tokens):
        ref.append(target_law(logits, p, hist).draw(rng))
        hist.append(ref[-1])
        smollm2.decode([ref[-1]], [len(hist) - 1])
        logits = smollm2.logits_row(-1)
    smollm2.clear()
    assert ours.n_tokens > 0 and ours.tokens == ref


def test_target_distribution_matches_manual_chain():
    rng = np.random.default_rng(0)
    # float32, as llama.cpp hands logits to its samplers (target_distribution keeps them so)
    logits = (rng.normal(size=50) * 3).astype(np.float32).astype(np.float64)
    p = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, min_p=0.0)
    probs = target_distribution(logits, p)
    # by hand: top-10 by logit, then the smallest top-p prefix of their softmax, then temperature
    order = np.argsort(-logits)[:10]
    q = np.exp(logits[order] - logits[order].max())
    q /= q.sum()
    cut = int(np.searchsorted(np.cumsum(q), 0.8)) + 1
    kept = order[:cut]
    expect = np.zeros(50)
    e = np.exp((logits[kept] - logits[kept].max()) / 0.7)
    expect[kept] = e / e.sum()
    np.testing.assert_allclose(probs, expect, rtol=1e-12, atol=1e-15)


def test_cli_json_contract():
    r = run_cli("generate", "Say hello.", "--max-tokens", "8", "--json", "--seed", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "tokens", "n_tokens", "stats"}
    assert out["n_tokens"] == len(out["tokens"]) and 0 < out["n_tokens"] <= 8
    s = out["stats"]
    for key, typ in [("method", str), ("tau", float), ("target_passes", int), ("tokens_per_s", float),
                     ("draft_s", float), ("verify_s", float), ("draft_fraction", float), ("accept_hist", list)]:
        assert isinstance(s[key], typ), key
    assert s["method"] == "ngram" and s["drafter_backend"] is None and s["tau"] >= 1.0  # the default method
    assert sum(s["accept_hist"]) == s["target_passes"]
    assert isinstance(out["text"], str) and out["text"]


def test_cli_raw_skips_template():
    r = run_cli("generate", "The capital of France is", "--raw", "--max-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_tokens"] > 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_default_method_is_the_lookup_and_keeps_plains_output(temperature):
    """No method and no drafter: the n-gram lookup at depth auto (engine.setup.default_method). Its
    drafts are deterministic, so its output is plain decoding's token for token, greedy and sampled
    with the same seed (sample-and-match draws each token as a plain step does)."""
    from blockspec.runtime.frontends.api import run_generate

    prompt = "Write the sentence 'the cat sat on the mat' five times, one per line."
    got = run_generate(prompt, max_tokens=96, temperature=temperature, seed=7)
    want = run_generate(prompt, max_tokens=96, temperature=temperature, seed=7, method="plain")
    assert got.stats.method == "ngram" and got.stats.drafted > 0
    assert got.tokens == want.tokens
