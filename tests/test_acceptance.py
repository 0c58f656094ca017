"""Acceptance rules on hand-built logits: greedy cases, and exact distributions for sampling."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from blockspec.runtime.engine.acceptance import accept, accept_greedy, accept_sampled
from blockspec.runtime.engine.sampling import Law, SamplingParams, chain_law, target_distribution, target_law
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.drafters.tree import DraftTree

V = 6
GREEDY = SamplingParams(temperature=0.0)


def onehot_logits(*argmaxes):
    rows = np.zeros((len(argmaxes), V))
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


def test_greedy_chain_accepts_matching_prefix_then_recovers():
    tree = DraftTree.chain(0, [3, 4, 5])
    # target argmax after root=3, after 3 -> 4, after 4 -> 1 (draft said 5)
    v = accept_greedy(tree, onehot_logits(3, 4, 1, 2), GREEDY, [0])
    assert v.accepted == [1, 2] and v.token == 1 and not v.bonus


def test_greedy_chain_full_accept_gives_bonus():
    tree = DraftTree.chain(0, [3, 4])
    v = accept_greedy(tree, onehot_logits(3, 4, 2), GREEDY, [0])
    assert v.accepted == [1, 2] and v.token == 2 and v.bonus


def test_greedy_tree_follows_matching_branch():
    tree = DraftTree.from_paths(0, [[1, 2], [3, 4], [3, 5]])
    # nodes: 0 root, 1:'1', 2:'2', 3:'3', 4:'4', 5:'5'
    assert tree.parents == [-1, 0, 1, 0, 3, 3]
    rows = onehot_logits(3, 0, 0, 5, 0, 2)  # root->3, node3->5, node5->2
    v = accept_greedy(tree, rows, GREEDY, [0])
    assert v.accepted == [3, 5] and v.token == 2 and v.bonus


def test_seq_ids_cover_leaves():
    tree = DraftTree.from_paths(0, [[1, 2], [3, 4], [3, 5]])
    ids, leaves = tree.seq_ids(base=1)
    assert leaves == [2, 4, 5]
    assert ids[0] == [1, 2, 3] and ids[3] == [2, 3] and ids[5] == [3]


def _chi2_first_two(draws: np.ndarray, exact: np.ndarray, n: int) -> float:
    counts = np.bincount(draws, minlength=exact.size).astype(float)
    keep = exact * n >= 5  # pool rare cells
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(exact[keep] * n, exact[~keep].sum() * n)
    mask = exp > 0
    return sps.chisquare(obs[mask], exp[mask]).pvalue


@pytest.mark.parametrize("temperature", [0.6, 1.3])
@pytest.mark.parametrize("kind", ["chain-q", "tree-q", "tree-match", "chain-match", "siblings-no-replacement",
                                  "branches-own-q"])
def test_sampled_acceptance_reproduces_target_distribution(kind, temperature):
    """Joint law of the first two emitted tokens equals the target's, for drafts with and
    without draft probabilities, siblings drawn with and without replacement and from different
    laws (chi-square over 36 cells, 20k trials; p > 1e-4, so the 12 cases together have a
    false-alarm rate of ~0.1%; seeds are fixed, so runs repeat)."""
    rng = np.random.default_rng([7, int(temperature * 10), len(kind)])
    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
    base = rng.normal(size=(V + 1, V)) * 1.5  # target logits: row 0 at root, row 1+x after token x
    p1 = target_distribution(base[0], params)
    p2 = np.stack([target_distribution(base[1 + x], params) for x in range(V)])
    exact = (p1[:, None] * p2).ravel()
    q = np.full(V, 1.0 / V) * 0.5 + 0.5 * np.eye(V)[2]  # a deliberately wrong draft distribution
    q2 = np.full(V, 1.0 / V) * 0.3 + 0.7 * np.eye(V)[4]  # another
    lq, lq2 = Law.of(q), Law.of(q2)

    n = 20000
    firsts = np.empty(n, dtype=int)
    for i in range(n):
        if kind == "chain-q":
            d0 = int(rng.choice(V, p=q)); d1 = int(rng.choice(V, p=q))
            tree = DraftTree.chain(0, [d0, d1], q=[lq, lq])
        elif kind == "tree-q":
            a, b = (int(x) for x in rng.choice(V, size=2, p=q))
            tree = DraftTree([0, a, b, int(rng.choice(V, p=q))], [-1, 0, 0, 1], [None, lq, lq, lq])
        elif kind == "siblings-no-replacement":  # 3 distinct first tokens, a spine below the first
            tree = DraftTree.sampled(0, [[lq, lq]], [3, 1], 4, rng)
        elif kind == "branches-own-q":  # two branches, each from its own laws
            tree = DraftTree.sampled(0, [[lq, lq], [lq2, lq]], [1, 1], 4, rng)
        elif kind == "tree-match":
            tree = DraftTree.from_paths(0, [[1, 2], [3, 1], [3, 4]])
        else:
            tree = DraftTree.chain(0, [1, 1])
        logits = np.stack([base[0]] + [base[1 + t] for t in tree.tokens[1:]])
        v = accept_sampled(tree, logits, params, rng, [0])
        emitted = [tree.tokens[j] for j in v.accepted] + [v.token]
        if len(emitted) < 2:  # only one token this pass: the second comes from the next pass
            x1 = emitted[0]
            x2 = int(rng.choice(V, p=p2[x1]))
        else:
            x1, x2 = emitted[:2]
        firsts[i] = x1 * V + x2
    assert _chi2_first_two(firsts, exact, n) > 1e-4


def test_drafter_equal_target_accepts_everything():
    """A drafter whose q equals the target's p is never rejected."""
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    logits = rng.normal(size=V)
    p = target_distribution(logits, params)
    for _ in range(500):
        d = [int(rng.choice(V, p=p)) for _ in range(3)]
        tree = DraftTree.chain(0, d, q=[Law.of(p)] * 3)
        v = accept(tree, np.stack([logits] * 4), params, rng, [0])
        assert len(v.accepted) == 3 and v.bonus


def _full_vocab_distribution(x, p):
    """The sampler chain written out over the whole vocabulary (penalty-free): top-k -> top-p ->
    min-p on the untempered softmax -> temperature. target_distribution works on top-k's
    candidates only; both must describe the same distribution."""
    n = x.shape[0]
    keep = np.ones(n, dtype=bool)
    if 0 < p.top_k < n:  # llama.cpp's top-k: exactly k, its partial sort breaking ties
        keep &= np.isin(np.arange(n), _llama_top_k(x.astype(np.float32), p.top_k))
    q = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    q /= q.sum()
    if p.top_p < 1.0:
        order = np.argsort(-q, kind="stable")
        cut = int(np.searchsorted(np.cumsum(q[order]), p.top_p, side="left")) + 1
        keep &= np.isin(np.arange(n), order[:cut])
    if p.min_p > 0.0:
        keep &= q >= p.min_p * q.max()
    e = np.where(keep, np.exp((x - x[keep].max()) / p.temperature), 0.0)
    return e / e.sum()


@pytest.mark.parametrize("top_k,top_p,min_p", [(40, 0.95, 0.05), (0, 0.9, 0.0), (5, 1.0, 0.0), (0, 1.0, 0.1), (3, 0.5, 0.0)])
def test_target_distribution_equals_full_vocabulary_chain(top_k, top_p, min_p):
    rng = np.random.default_rng(top_k)
    for temp in (0.7, 1.0, 1.5):
        p = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
        for trial in range(5):
            x = rng.standard_normal(2000) * 3
            x[rng.integers(0, 2000, 20)] = x.max()  # ties at the top: id order decides
            np.testing.assert_allclose(target_distribution(x.astype(np.float32), p),
                                       _full_vocab_distribution(x.astype(np.float32).astype(np.float64), p),
                                       rtol=1e-12, atol=1e-15)


def _llama_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """llama.cpp's top-k sampler itself over float32 logits in id order (as its samplers see
    them), through ctypes: the kept ids."""
    import ctypes

    from llama_cpp import llama_cpp

    data = np.empty(len(x), dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    data["id"], data["logit"], data["p"] = np.arange(len(x)), x, 0.0
    arr = llama_cpp.llama_token_data_array(data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                           size=len(x), selected=-1, sorted=False)
    smpl = llama_cpp.llama_sampler_init_top_k(k)
    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
    llama_cpp.llama_sampler_free(smpl)
    return data["id"][:arr.size].copy()


def test_top_k_keeps_exactly_k_on_ties():
    """Top-k keeps exactly k candidates when logits tie at the k-th place (llama.cpp's own top-k
    decides which of the tied tokens stay); the rest of the chain then sees those k only."""
    x = np.zeros(1000, dtype=np.float32)
    x[[3, 500, 999]] = 2.0  # three clear winners, then 997 tokens tied at 0
    for k in (1, 3, 5, 40):
        law = target_law(x, SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0))
        assert len(law.ids) == k and set(law.ids.tolist()) == set(_llama_top_k(x, k).tolist())
        assert set(law.ids.tolist()) >= {3, 500, 999} if k >= 3 else set(law.ids.tolist()) <= {3, 500, 999}


def test_top_k_is_llama_cpps_top_k():
    """The chain (patch 0010) finds the k best from block maxima where the k-th logit is not tied
    and hands ties to llama.cpp's top-k: either way it keeps the set llama.cpp's own sampler keeps,
    on real-vocabulary-sized logits, with many ties at the k-th place."""
    rng = np.random.default_rng(3)
    for trial in range(300):
        x = rng.standard_normal(49152) * rng.uniform(0.5, 6)
        if trial % 3 == 0:
            x = np.round(x * rng.choice([1, 4, 16])) / 4  # many ties, some at the k-th place
        x = x.astype(np.float32)
        for k in (1, 5, 40, 200):
            law = target_law(x, SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0))
            assert len(law.ids) == k and set(law.ids.tolist()) == set(_llama_top_k(x, k).tolist())


def test_bad_chain_arguments_fail_in_one_line():
    with pytest.raises(BlockspecError, match="sampling over 3 logits failed"):
        chain_law(np.zeros(3, np.float32), SamplingParams(temperature=-1.0))


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0),
                                    dict(temperature=1.0, top_p=0.5, repeat_penalty=1.3)])
def test_sample_over_the_support_is_the_dense_draw(params):
    """Plain decoding samples over the target distribution's support alone (sampling.sample); it
    must draw, seed for seed, the token the dense inverse CDF (`draw`) draws."""
    from blockspec.runtime.engine.sampling import draw, sample

    rs = np.random.default_rng(0)
    p = SamplingParams(**params)
    for trial in range(200):
        x = (rs.standard_normal(4096) * 3).astype(np.float32)
        x[:64] = np.round(x[:64])  # ties
        hist = list(rs.integers(0, 4096, 16))
        assert sample(x, p, np.random.default_rng(trial), hist) == \
            draw(target_distribution(x, p, hist), np.random.default_rng(trial))


def test_law_on_its_support_is_the_dense_computation():
    """sampling.Law (acceptance and drafting hold laws by their support) gives the dense vector's
    masses, residual and draws: residuals to float rounding, draws seed for seed."""
    from blockspec.runtime.engine.sampling import draw

    rs = np.random.default_rng(1)
    n = 64
    for trial in range(300):
        p, q = (rs.dirichlet(np.ones(n)) * (rs.random(n) < 0.3) for _ in range(2))
        p[rs.integers(n)] += 0.1  # never empty
        q[rs.integers(n)] += 0.1
        p, q = p / p.sum(), q / q.sum()
        lp, lq = Law.of(p), Law.of(q)
        np.testing.assert_array_equal(lp.at(np.arange(n)), p)
        assert [lp[x] for x in range(n)] == p.tolist()
        r = np.maximum(p - q, 0.0)
        res = lp.residual(lq)
        if r.sum() > 0:
            np.testing.assert_allclose(res.dense(n), r / r.sum(), rtol=1e-12, atol=1e-15)
        else:
            assert res is None
        assert lp.draw(np.random.default_rng(trial)) == draw(p, np.random.default_rng(trial))
        tok = lp.draw(np.random.default_rng(trial))
        rest = p.copy()
        rest[tok] = 0
        if rest.sum() > 0:
            np.testing.assert_allclose(lp.without(tok).dense(n), rest / rest.sum(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)])
def test_sample_takes_the_laws_token_and_uniform_seed_for_seed(params):
    """sample (patch 0012: the law and its draw in one C call, no law handed back) and
    target_law(...).draw take the same token and one uniform each, so a seed gives the same tokens
    either way: sample-and-match keeps plain decoding's output for the same seed. The second case's
    law is the whole vocabulary (Law.draw's numpy cumsum, not its short-list walk)."""
    from blockspec.runtime.engine.sampling import sample

    rs = np.random.default_rng(2)
    p = SamplingParams(**params)
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    for _ in range(100):
        x = (rs.standard_normal(49152) * 4).astype(np.float32)
        assert sample(x, p, a) == target_law(x, p).draw(b)
    assert a.random() == b.random()


def test_greedy_draw_is_numpys_argmax():
    """blockspec_sample at temperature 0, which plain greedy steps take on the target's row in
    place: numpy's argmax, ties to the first, a NaN the largest, rows of -inf, any length."""
    from blockspec.runtime.llama.ext import blockspec_sample

    rs = np.random.default_rng(3)
    rows = [np.round(rs.standard_normal(n)).astype(np.float32) for n in (1, 63, 64, 65, 5000) for _ in range(20)]
    for pos in ((3000,), (17, 4000)):
        x = rs.standard_normal(5000).astype(np.float32)
        x[list(pos)] = np.nan
        rows.append(x)
    rows += [np.full(5000, -np.inf, np.float32), np.where(np.arange(5000) == 4999, np.inf, 0.0).astype(np.float32)]
    for x in rows:
        assert blockspec_sample(x.ctypes.data, x.shape[0], 40, 0.95, 0.05, 0.0, 0.0) == int(np.argmax(x))
