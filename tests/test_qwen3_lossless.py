"""Lossless speculative decoding on the Qwen3 architecture, with a small random-weight Qwen3 GGUF
built here (no real Qwen3 weights are obtainable). Its tokenizer is SmolLM2's, copied from the
bundled GGUF's tokenizer.* metadata, so llama.cpp tokenizes text for it. Weights are scaled up
(embeddings std 1, an untied head of std 0.4) so the next-token distributions are peaked enough
for the checks to bite without being one-hot.

Greedy: ngram chain and tree, and a drafter proposing the target's own continuation, give exactly
the plain output. Sampled: the joint distribution of the first two tokens under tree speculation
at temperature 1 matches the exact target distribution (chi-square).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.drafters.ngram import NgramDrafter
from fixed_drafter import FixedDrafter
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.engine.sampling import SamplingParams, target_distribution
from blockspec.runtime.llama.target import Target, TargetConfig
from blockspec.runtime.drafters.tree import DraftTree

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

GREEDY = SamplingParams(temperature=0.0)
TINY = dict(arch="qwen3", dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=128,
            vocab_size=49152, tied_embeddings=False)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small village,"]


def write_qwen3_gguf(path, tokenizer_gguf, seed: int = 0, std: float = 1.0, head_std: float = 0.4) -> None:
    """A random Qwen3 GGUF (F32) whose tokenizer metadata is copied from `tokenizer_gguf`."""
    from blockspec.models import target as tgt
    from fixtures_target import write_tiny_gguf

    args = tgt.ModelArgs(**TINY)
    torch.manual_seed(seed)
    model = tgt.TargetModel(args)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif n == "tok_embeddings.weight":
                p.normal_(0.0, std)
            elif n == "output.weight":
                # logits ~ N(0, head_std^2 * dim): a few logits apart at the top, so the top-3 are
                # all likely (a tied head of std 1 would just repeat the last token, p ~ 1)
                p.normal_(0.0, head_std)
            else:
                p.normal_(0.0, std / p.shape[-1] ** 0.5)
    write_tiny_gguf(path, args, state=model.state_dict(), tokenizer_from=tokenizer_gguf)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_path):
    path = tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf"
    write_qwen3_gguf(path, smollm2_path, seed=0)
    with Target(path, TargetConfig(n_ctx=512, n_seq_max=16)) as t:
        assert t.arch == "qwen3" and t.n_vocab == TINY["vocab_size"] and t.n_embd == TINY["dim"]
        yield t


@pytest.mark.parametrize("text", TEXTS)
def test_greedy_speculative_equals_plain(qwen3, text):
    prompt = qwen3.tokenize(text, add_special=True)
    assert len(prompt) > 5
    plain = generate(qwen3, prompt, max_tokens=96, sampling=GREEDY).tokens
    assert len(plain) == 96
    for drafter in [NgramDrafter(block_size=4), NgramDrafter(block_size=3, branches=3)]:
        spec = generate(qwen3, prompt, max_tokens=96, sampling=GREEDY, drafter=drafter)
        assert spec.tokens == plain, f"ngram branches={drafter.branches}"
    block = 5
    spec = generate(qwen3, prompt, max_tokens=96, sampling=GREEDY,
                    drafter=FixedDrafter(plain, start=len(prompt), block_size=block))
    assert spec.tokens == plain
    assert spec.stats.accept_hist[block] >= spec.stats.target_passes - 2
    assert spec.stats.tau > block


class FirstStepTree(Drafter):
    """At the first step (root = x1) proposes x1's two most likely successors, the first with a
    grandchild; later steps (cut off by max_tokens) propose nothing."""

    max_nodes, max_leaves = 3, 2

    def __init__(self, n_prompt: int, successors: dict[int, list[int]]):
        self.n_prompt, self.successors = n_prompt, successors

    def propose(self, history, sampler=None):
        root = int(history[-1])
        if len(history) != self.n_prompt + 1:
            return DraftTree([root], [-1])
        a, b = self.successors[root][:2]
        return DraftTree.from_paths(root, [[a, a], [b]])


def test_sampled_first_two_tokens_follow_target_distribution(qwen3):
    from scipy.stats import chisquare

    sp = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    prompt = qwen3.tokenize(TEXTS[0], add_special=True)
    n = len(prompt)
    # exact joint p(x1, x2) from the prefill logits and one decode per x1
    qwen3.clear()
    p1 = target_distribution(qwen3.prefill(prompt), SamplingParams(**sp), prompt)
    joint, successors = {}, {}
    for x1 in np.nonzero(p1)[0].tolist():
        qwen3.decode([x1], [n])
        p2 = target_distribution(qwen3.logits_row(-1), SamplingParams(**sp), prompt + [x1])
        qwen3.remove(-1, n, -1)
        successors[x1] = np.argsort(-p2)[:2].tolist()
        for x2 in np.nonzero(p2)[0].tolist():
            joint[(x1, x2)] = p1[x1] * p2[x2]
    qwen3.clear()
    assert len(joint) == 9 and not any(qwen3.is_eog(t) for pair in joint for t in pair)
    assert max(joint.values()) < 0.9, joint  # peaked, but not degenerate

    N = 300
    counts: Counter = Counter()
    accepted = 0
    for seed in range(N):
        gen = generate(qwen3, prompt, max_tokens=2, sampling=SamplingParams(**sp, seed=seed),
                       drafter=FirstStepTree(n, successors))
        counts[tuple(gen.tokens)] += 1
        accepted += sum(k * c for k, c in enumerate(gen.stats.accept_hist))
    assert set(counts) <= set(joint), set(counts) - set(joint)
    keys = sorted(joint, key=joint.get, reverse=True)
    exp = np.array([N * joint[k] for k in keys])
    obs = np.array([counts[k] for k in keys], dtype=float)
    # pool the rare outcomes so every bin expects >= 5
    big = exp >= 5
    if (~big).any():
        exp = np.append(exp[big], exp[~big].sum())
        obs = np.append(obs[big], obs[~big].sum())
    p = chisquare(obs, exp).pvalue
    print(f"\njoint {[round(joint[k], 3) for k in keys]}, counts {[counts[k] for k in keys]}, "
          f"accepted draft tokens {accepted}/{N}, chi-square p {p:.3g}")
    assert accepted > N // 3  # the tree's children were really accepted, not just replaced
    assert p > 1e-4
