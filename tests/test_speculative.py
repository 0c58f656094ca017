"""The speculative engine on the real bundled model: lossless greedy output, exact cache
state after tree commits, tree-node logits, and acceptance of well-informed drafts."""

from __future__ import annotations

import numpy as np
import pytest

from blockspec.runtime.drafters.ngram import NgramDrafter
from fixed_drafter import FixedDrafter
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.engine.speculative import verify_tree
from blockspec.runtime.llama.target import Target, TargetConfig
from blockspec.runtime.drafters.tree import DraftTree

from prompts import PROMPTS

GREEDY = SamplingParams(temperature=0.0)
N_NEW = 128


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=2048, n_seq_max=8)) as t:
        yield t


def _near_tie_report(target, prompt, spec_tokens, plain_tokens):
    """First divergence between spec and plain: the target's top-2 logit gap there,
    computed by a fresh single-sequence prefill of the common prefix."""
    k = next(i for i, (a, b) in enumerate(zip(spec_tokens, plain_tokens)) if a != b)
    target.clear()
    logits = target.prefill(list(prompt) + list(plain_tokens[:k]))
    top2 = np.sort(logits)[-2:]
    return k, float(top2[1] - top2[0])


@pytest.mark.parametrize("drafter", [NgramDrafter(block_size=4), NgramDrafter(block_size=3, branches=3)],
                         ids=["chain", "tree"])
def test_greedy_speculative_equals_plain(target, drafter):
    mismatches, total_tau = [], []
    for text in PROMPTS:
        prompt = prompt_tokens(target, text)
        plain = generate(target, prompt, max_tokens=N_NEW, sampling=GREEDY)
        spec = generate(target, prompt, max_tokens=N_NEW, sampling=GREEDY, drafter=drafter)
        total_tau.append(spec.stats.tau)
        if spec.tokens != plain.tokens:
            mismatches.append((text, *_near_tie_report(target, prompt, spec.tokens, plain.tokens)))
    # verify batches and single-token decodes round identically here (flash attention,
    # patch 0004, < 64 rows, packed tree commits), so the outputs must be equal outright;
    # a failure reports where it diverged and how close the target's top-2 logits were
    assert not mismatches, [f"{t!r}: diverged at {pos}, top-2 gap {gap:.4f}" for t, pos, gap in mismatches]
    print(f"\n{drafter.name} branches={drafter.max_leaves}: mean tau {np.mean(total_tau):.2f}, "
          f"{len(mismatches)} near-tie divergences of {len(PROMPTS)}")


def test_drafter_proposing_target_greedy_gets_full_acceptance(target):
    prompt = prompt_tokens(target, PROMPTS[0])
    plain = generate(target, prompt, max_tokens=64, sampling=GREEDY)
    block = 5
    spec = generate(target, prompt, max_tokens=64, sampling=GREEDY,
                    drafter=FixedDrafter(plain.tokens, start=len(prompt), block_size=block))
    assert spec.tokens == plain.tokens
    # every pass but the prefill and the last accepts the whole block
    assert spec.stats.accept_hist[block] >= spec.stats.target_passes - 2
    assert spec.stats.tau > block


def test_ngram_on_repetitive_text_accepts_most_of_its_block(target):
    line = "alpha beta gamma delta epsilon zeta eta theta iota kappa. "
    prompt = target.tokenize(line * 6, add_special=True)
    spec = generate(target, prompt, max_tokens=200, sampling=GREEDY, drafter=NgramDrafter(block_size=4))
    # block 4: at most 5 tokens a pass; the model needs a few passes to fall into repetition
    assert spec.stats.tau >= 4.0, spec.stats


def test_cache_after_200_steps_equals_fresh_prefill(target):
    prompt = prompt_tokens(target, PROMPTS[18])
    drafter = NgramDrafter(block_size=2, branches=3)  # at most 3 tokens a pass: >= 200 passes
    gen = generate(target, prompt, max_tokens=700, sampling=GREEDY, drafter=drafter)
    assert gen.stats.target_passes >= 200 or gen.finish_reason == "stop", gen.stats
    # the engine's cache holds prompt + emitted[:-1]; decoding the last emitted token must
    # give the same next-token logits as a fresh cache built from the same tokens
    seq = prompt + gen.tokens
    assert target.cached == seq[:-1]
    target.decode([seq[-1]], [len(seq) - 1])
    after_spec = target.logits_row(-1)
    # fresh, the way plain decoding builds it (prompt in one batch, then token by token): bit-exact
    target.clear()
    target.prefill(prompt)
    for i in range(len(prompt), len(seq)):
        target.decode([seq[i]], [i])
    np.testing.assert_array_equal(after_spec, target.logits_row(-1))
    # fresh in n_batch chunks: batches of >= 64 tokens take ggml's tiled attention kernel,
    # which rounds differently; the prediction must still agree
    target.clear()
    fresh = target.prefill(seq)
    assert int(np.argmax(after_spec)) == int(np.argmax(fresh))
    print(f"\n{len(seq)} tokens, {gen.stats.target_passes} passes; max |logit diff| vs one-batch prefill: "
          f"{np.abs(after_spec - fresh).max():.3f}")


def test_tree_node_logits_equal_path_alone(target):
    prompt = prompt_tokens(target, PROMPTS[2])
    target.clear()
    target.prefill(prompt[:-1])
    target.cached = prompt[:-1]
    a, b, c, d = target.tokenize(" lists are mutable while tuples", add_special=False)[:4]
    tree = DraftTree.from_paths(prompt[-1], [[a, b, c], [a, d], [c, b], [d]])
    n_past = len(prompt) - 1
    logits, _, _, n_seqs = verify_tree(target, tree, n_past)
    assert n_seqs == len(tree.leaves())
    # the one-copy read of all rows is the per-row read, in batch order
    np.testing.assert_array_equal(logits, np.stack([target.logits_row(i) for i in range(len(tree))]))
    for leaf in [i for i in tree.leaves()]:
        path = tree.path(leaf)
        target.clear()
        target.prefill(prompt[:-1])
        target.decode([tree.tokens[i] for i in path], [n_past + k for k in range(len(path))],
                      logits=[True] * len(path))
        alone = np.stack([target.logits_row(k) for k in range(len(path))])
        # flash attention skips masked cells, and every batch here is below 64 tokens: exact
        np.testing.assert_array_equal(logits[path], alone)


def test_exact_batch_limit_probe(target):
    # measured on this build: SmolLM2 Q4_1 is batch-invariant up to flash attention's
    # tiled kernel at 64 rows
    limit = target.exact_batch_limit
    assert 2 <= limit <= 63
    print(f"\nSmolLM2 Q4_1 exact batch limit: {limit}")


def test_trees_are_cut_to_the_exact_batch_limit(target, monkeypatch):
    prompt = prompt_tokens(target, PROMPTS[19])
    plain = generate(target, prompt, max_tokens=48, sampling=GREEDY)
    monkeypatch.setattr(target, "_exact_limit", 2)  # root + one drafted node per pass
    spec = generate(target, prompt, max_tokens=48, sampling=GREEDY, drafter=NgramDrafter(block_size=4, branches=2))
    assert spec.tokens == plain.tokens
    assert len(spec.stats.accept_hist) <= 2


def test_a_tree_at_the_end_of_the_context_keeps_the_nodes_that_fit(smollm2_path):
    # a repetitive text drafts full n-gram trees right up to the last free KV cell
    with Target(smollm2_path, TargetConfig(n_ctx=256, n_seq_max=8)) as t:
        prompt = t.tokenize("a b c d e f g h i j k l m n o p q r s t u v w x y z a b c d e f g h i j")
        plain = generate(t, prompt, max_tokens=500, sampling=GREEDY)
        spec = generate(t, prompt, max_tokens=500, sampling=GREEDY, drafter=NgramDrafter(block_size=6, branches=3))
        n_ctx = t.n_ctx
    assert len(prompt) + len(plain.tokens) == n_ctx and plain.finish_reason == "length"
    assert spec.tokens == plain.tokens and spec.finish_reason == "length"
    assert sum(spec.stats.accept_hist[1:]) > 0


def test_greedy_lossless_on_qwen_k_quants():
    """Q4_K_M weights: upstream's tiled K-quant matmul (8+ rows) sums in another order than a
    single row's vec_dot; patch 0004 keeps batches under 64 rows off it, so every verify batch the
    engine makes equals the rows alone, and the output equals plain decoding."""
    from blockspec.runtime.llama.target import PROBE_MAX
    from blockspec.runtime.format.modelfile import fetch

    with Target(fetch("qwen2.5-coder-0.5b", progress=False), TargetConfig(n_ctx=1024, n_seq_max=8)) as t:
        limit = t.exact_batch_limit
        assert limit == PROBE_MAX
        for text in ["Write a Python function that reverses a list.", "Count from 1 to 30, separated by commas."]:
            prompt = prompt_tokens(t, text)
            plain = generate(t, prompt, max_tokens=64, sampling=GREEDY)
            spec = generate(t, prompt, max_tokens=64, sampling=GREEDY, drafter=NgramDrafter(block_size=3, branches=2))
            assert spec.tokens == plain.tokens, f"limit {limit}"
        print(f"\nqwen2.5-coder-0.5b Q4_K_M exact batch limit: {limit}")
