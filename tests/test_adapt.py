"""SpecBlock's online adaptation (runtime/engine/adapt.py) and the in-place weight writes it rests on
(ggml_patches/0009, GgmlBlockDrafter.set_tensor): the shipped q8_0 drafter on the bundled target.

  - set_tensor writes f32 and q8_0 weights in place (read back where the layout allows; drafts
    follow the new weights), refuses bad names / sizes / read-only mmapped weights with no change;
  - the bandit's decisions on synthetic signals and costs;
  - greedy output with --adapt over several requests equals plain decoding after updates of both
    kinds, and the ggml drafter then agrees with the updated torch copy;
  - --adapt refused, in one line, where there is no SpecBlock drafter.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from blockspec.runtime.drafters.tree import DraftTree
from blockspec.runtime.engine.acceptance import Verdict
from blockspec.runtime.engine.adapt import (AdaptConfig, CostAwareBandit, attach_adapter, check_adapt_method,
                                            rejection_signal)
from blockspec.runtime.errors import BlockspecError

from conftest import run_cli
from prompts import PROMPTS

torch = pytest.importorskip("torch")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(smollm2_path):
    from blockspec.runtime.llama.target import Target, TargetConfig

    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_seq_max=2, n_threads=1)) as t:
        yield t


def _drafter(path, target, writable=True):
    from blockspec.runtime.engine.setup import make_drafter

    d = make_drafter("specblock", path, "ggml", block_size=4)
    if writable:
        d.make_writable()
    d.check_target(target)
    return d


def _feed(d, target, tokens):
    """The drafter holding `tokens[:-1]` with the target's real taps (as after a prefill)."""
    target.clear()
    target.enable_taps(d.target_layers)
    target.decode(tokens[:-1], range(len(tokens) - 1), logits=[False] * (len(tokens) - 1))
    d.trim(0)
    d.observe(tokens[:-1], 0, {lid: target.tap(lid).copy() for lid in d.target_layers})
    target.clear()


@pytest.fixture(scope="module")
def history(target):
    from blockspec.runtime.llama.prompt import prompt_tokens

    return prompt_tokens(target, PROMPTS[5])


# ---------------------------------------------------------------------------------------- patch 0009
def test_set_tensor_f32_in_place(shipped_specblock, target, history):
    d = _drafter(shipped_specblock, target)
    _feed(d, target, history)
    before = d.get_tensor("output_norm.weight")
    logits0, _ = d.block_outputs(history)
    d.set_tensor("output_norm.weight", before * 2.0)
    assert np.array_equal(d.get_tensor("output_norm.weight"), before * 2.0)
    logits1, _ = d.block_outputs(history)
    assert not np.allclose(logits0, logits1)  # the next pass reads the new weights, nothing reloaded
    d.set_tensor("output_norm.weight", before)
    assert np.array_equal(d.block_outputs(history)[0], logits0)
    d.close()


def test_set_tensor_q8_0_in_place(shipped_specblock, target, history):
    d = _drafter(shipped_specblock, target)
    _feed(d, target, history)
    n, shape, ggml_type = d._tensor("output.weight")
    assert ggml_type == 8 and shape == (4096, 576)  # GGML_TYPE_Q8_0, [draft vocab, width]
    base = d.block_outputs(history)[0]
    # the torch copy's dequantised q8_0 values requantise to the very same blocks
    from blockspec.models.checkpoint import read_drafter_gguf

    model, _ = read_drafter_gguf(shipped_specblock)
    w = model.vocab.lm_head.weight.detach().numpy()
    try:
        assert np.array_equal(d.get_tensor("output.weight"), w)
    except BlockspecError as e:  # weights repacked for the CPU cannot be read back
        assert "repacked" in str(e)
    d.set_tensor("output.weight", np.zeros_like(w))  # every draft logit 0: the first draft id everywhere
    zero = d.block_outputs(history)[0]
    assert np.all(zero == 0.0)
    assert d.propose(history).tokens[1:] == [int(d.d2t[0])] * 4
    d.set_tensor("output.weight", w)
    assert np.array_equal(d.block_outputs(history)[0], base)
    d.close()


def test_set_tensor_bad_input_changes_nothing(shipped_specblock, target, history):
    d = _drafter(shipped_specblock, target)
    _feed(d, target, history)
    base = d.block_outputs(history)[0]
    w = d.get_tensor("output_norm.weight")
    with pytest.raises(BlockspecError, match="no tensor 'token_embd.weight'"):
        d.set_tensor("token_embd.weight", w)  # the target's, borrowed through ctx_other: never written
    with pytest.raises(BlockspecError, match="has shape"):
        d.set_tensor("output_norm.weight", w[:-1])
    with pytest.raises(BlockspecError, match="has shape"):
        d.set_tensor("output.weight", np.zeros((576, 4096), np.float32))  # transposed
    from blockspec.runtime.llama import ext

    bad = np.zeros(10, np.float32)  # the C side checks the size itself too
    assert ext.blockspec_model_set_tensor(d._model, b"output_norm.weight", bad.ctypes.data_as(
        ext.ctypes.POINTER(ext.ctypes.c_float)), 10) == -2
    assert ext.blockspec_model_set_tensor(d._model, b"nope", bad.ctypes.data_as(
        ext.ctypes.POINTER(ext.ctypes.c_float)), 10) == -1
    assert np.array_equal(d.block_outputs(history)[0], base)
    d.close()


def test_mmapped_weights_are_refused_not_faulted(shipped_specblock, target):
    d = _drafter(shipped_specblock, target, writable=False)
    w = d.get_tensor("output_norm.weight")  # reading a mapped tensor is fine
    with pytest.raises(BlockspecError, match="read-only file mapping"):
        d.set_tensor("output_norm.weight", w * 2)
    assert np.array_equal(d.get_tensor("output_norm.weight"), w)
    d.close()


# ---------------------------------------------------------------------------------------- signal, bandit
def test_rejection_signal_hand_built():
    logits = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [1 / 3] * 3], np.float32))
    chain = DraftTree.chain(0, [0, 1, 2])  # node i+1 drafted after node i
    # node 1 (token 0, p 0.7) accepted; node 2 (token 1 under row 1: p 0.6) and node 3 (token 2 under
    # row 2: p 0.25) rejected
    s = rejection_signal(chain, logits, Verdict([1], 2, False))
    assert math.isclose(s, (1 - 0.6) + (1 - 0.25), rel_tol=1e-5)
    assert rejection_signal(chain, logits, Verdict([1, 2, 3], 0, True)) == 0.0
    # a tree: only the drafter's first choice per depth counts (siblings are alternatives)
    tree = DraftTree([0, 1, 2, 0], [-1, 0, 0, 1])
    assert math.isclose(rejection_signal(tree, logits, Verdict([], 0, False)), (1 - 0.2) + (1 - 0.1), rel_tol=1e-5)


def test_bandit_skips_without_signal_or_requests():
    b = CostAwareBandit()
    assert b.choose() == "skip"  # nothing seen yet
    b.end_request(signal=0.0, blocks=40, pass_s=0.02, tau=2.0)
    assert b.choose() == "skip"  # the drafter was never wrong: nothing to win


def test_bandit_updates_when_gain_is_high_and_skips_when_cost_exceeds_it():
    b = CostAwareBandit(AdaptConfig(prior_effect=0.2, horizon=10))
    b.end_request(signal=2.0, blocks=50, pass_s=0.02, tau=1.5)
    # gain = 0.2 tokens/block * 50 blocks * 10 requests * 0.02 s / 1.5 tokens per pass, either kind
    assert math.isclose(b.gain("head"), 0.2 * 50 * 10 * 0.02 / 1.5)
    assert b.choose() == "head"  # both untried (cost 0): the cheaper kind first
    b.record_update("head", 0.5, effect=0.0)  # won nothing on the held-back blocks
    assert b.effect["head"] < 0.2
    assert b.choose() == "full"  # untried, still at its prior
    b.record_update("full", 1.0, effect=0.6)  # won 0.6 tokens per block
    assert b.effect["full"] > 0.2
    assert b.net("full") > 0 and b.choose() == "full"
    # the same situation with updates far dearer than what they win: skip
    b.cost = {"head": 100.0, "full": 100.0}
    assert b.gain("full") < 100 and b.choose() == "skip"
    # a drafter that is never wrong (its signal's EWMA at 0) has nothing to win
    b.cost = {"head": 0.01, "full": 0.01}
    b.signal = 0.0
    assert b.choose() == "skip"
    # and an update that made things worse is not repeated at any cost
    c = CostAwareBandit(AdaptConfig(prior_effect=0.2, horizon=10))
    c.end_request(signal=2.0, blocks=50, pass_s=0.02, tau=1.5)
    c.available.discard("full")
    for _ in range(3):
        assert c.choose() == "head"
        c.record_update("head", 0.01, effect=-0.3)
        if c.effect["head"] < 0:
            break
    assert c.effect["head"] < 0 and c.choose() == "skip"


# ---------------------------------------------------------------------------------------- lossless session
def test_adapt_session_is_lossless_and_updates(shipped_specblock, target):
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.setup import make_drafter
    from blockspec.runtime.llama.prompt import prompt_tokens

    d = make_drafter("specblock", shipped_specblock, "ggml", block_size=4)
    # a large learning rate: the weights move far, so the drafts they give are unmistakably new
    cfg = AdaptConfig(prior_effect=0.5, horizon=1000.0, steps={"head": 2, "full": 1}, max_anchors=16, memory=3,
                      min_examples=2, lr={"head": 1e-2, "full": 1e-2})
    ad = attach_adapter(d, target, cfg)
    prompts = [prompt_tokens(target, p) for p in (PROMPTS[5], PROMPTS[2], PROMPTS[15], PROMPTS[5])]
    actions = []
    for i, toks in enumerate(prompts):
        spec = generate(target, toks, max_tokens=24, drafter=d)
        plain = generate(target, toks, max_tokens=24)
        assert spec.tokens == plain.tokens, f"request {i}: --adapt changed the output"
        a = spec.stats.adapt
        assert a is not None and a["blocks"] > 0 and a["action"] in ("skip", "head", "full")
        actions.append(a["action"])
        if i == 1:
            assert a["action"] == "head"  # a high prior and a long horizon: the update pays
            assert a["update_s"] > 0 and (a["effect"] > 0 or not a["kept"])  # kept only when it helped
            ad.update("full", keep_worse=True)  # both kinds written for certain, whatever they won
            ad.update("head", keep_worse=True)
    assert actions[0] == "skip"  # one request: nothing to train on besides the held-back one
    assert ad.updates["head"] >= 1 and ad.updates["full"] >= 1
    assert ad.updates["head"] + ad.undone["head"] >= 2
    assert spec.stats.adapt["update_s_total"] > 0 and spec.stats.adapt["updates"] == ad.updates

    # the ggml drafter now drafts with the torch copy's weights (q8_0 in llama.cpp), far from the
    # shipped ones: block logits at the last anchor, context K/V recomputed after each full update
    from blockspec.models.checkpoint import read_drafter_gguf

    hist = (prompts[-1] + spec.tokens)[:len(d.tokens) + 1]
    g_logits, _ = d.block_outputs(hist)
    t = len(hist) - 2
    args = (torch.from_numpy(ad.examples[-1].feats[:t + 1])[None], torch.tensor([[t]]), torch.tensor([[hist[-1]]]))
    shipped_model, _ = read_drafter_gguf(shipped_specblock)
    shipped_model.bind_target(ad.model.target_embed, ad.model.target_head)
    with torch.no_grad():
        t_logits = ad.model(*args).logits[0, 0].numpy()
        s_logits = shipped_model(*args).logits[0, 0].numpy()
    assert np.abs(g_logits - t_logits).max() < 1.0 < 5.0 < np.abs(s_logits - t_logits).max()
    d.close()


def test_an_update_that_hurts_the_held_back_request_is_undone(shipped_specblock, target):
    """A head update with a wrecking learning rate loses accepted tokens on the held-back request:
    it is undone -- the ggml drafter's head and the torch copy as before, the optimizer dropped."""
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.setup import make_drafter
    from blockspec.runtime.llama.prompt import prompt_tokens

    d = make_drafter("specblock", shipped_specblock, "ggml", block_size=4)
    cfg = AdaptConfig(prior_effect=0.0, steps={"head": 3, "full": 1}, lr={"head": 10.0, "full": 1e-4},
                      min_examples=2, max_anchors=32)
    ad = attach_adapter(d, target, cfg)  # prior 0: the bandit itself never updates
    for p in (PROMPTS[5], PROMPTS[2]):
        assert generate(target, prompt_tokens(target, p), max_tokens=32, drafter=d).stats.adapt["action"] == "skip"
    head_ggml = d.get_tensor("output.weight")
    head_torch = ad.model.vocab.lm_head.weight.detach().clone()
    seconds, effect, kept = ad.update("head")
    assert effect < 0 and not kept and seconds > 0
    assert ad.updates["head"] == 0 and ad.undone["head"] == 1 and "head" not in ad._opt
    np.testing.assert_array_equal(d.get_tensor("output.weight"), head_ggml)
    assert torch.equal(ad.model.vocab.lm_head.weight, head_torch)
    d.close()


def test_update_refuses_unknown_kind(shipped_specblock, target):
    from blockspec.runtime.engine.adapt import Adapter

    d = _drafter(shipped_specblock, target)
    ad = Adapter(d, target)
    with pytest.raises(BlockspecError, match="unknown update kind 'bogus'"):
        ad.update("bogus")
    d.close()


# ---------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("method", ["plain", "ngram", "dblast", "specblock+ngram"])
def test_adapt_refused_for_other_methods(method):
    with pytest.raises(BlockspecError, match=re.escape(f"needs --method specblock, not {method}")) as e:
        check_adapt_method(method)
    assert "\n" not in str(e.value)


def test_attach_refuses_a_drafter_without_specblock(target):
    with pytest.raises(BlockspecError, match="ggml backend\\), not plain decoding$"):
        attach_adapter(None, target)
    from blockspec.runtime.engine.setup import make_drafter

    with pytest.raises(BlockspecError, match="not --method ngram$"):
        attach_adapter(make_drafter("ngram"), target)
    with pytest.raises(BlockspecError, match=re.escape("not --method specblock (torch backend)")):
        attach_adapter(make_drafter("specblock", backend="torch"), target)


def test_cli_adapt_refused_and_json_stats():
    r = run_cli("generate", "hi", "--method", "dblast", "--adapt", "--max-tokens", "4")
    assert r.returncode == 1
    assert r.stderr.strip() == "blockspec: error: --adapt is SpecBlock's online adaptation: it needs --method " \
                               "specblock, not dblast"
    r = run_cli("generate", PROMPTS[2], "--method", "specblock", "--adapt", "--json", "--max-tokens", "12",
                env={"BLOCKSPEC_THREADS": "1", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    import json

    stats = json.loads(r.stdout)["stats"]
    assert stats["adapt"]["action"] in ("skip", "head", "full") and set(stats["adapt"]["updates"]) == {"head", "full"}


def test_api_adapt(smollm2_path):
    from blockspec.runtime.frontends.llama_api import SpeculativeLlama

    with pytest.raises(BlockspecError, match="needs --method specblock, not plain"):
        SpeculativeLlama(str(smollm2_path), method="plain", adapt=True)  # refused before anything loads
    with SpeculativeLlama(str(smollm2_path), method="specblock", adapt=True, n_ctx=512, n_threads=1) as llm:
        out = llm.create_completion(PROMPTS[3], max_tokens=12, temperature=0.0)
        assert out["choices"][0]["text"]
        a = llm.last_stats["adapt"]
        assert a["action"] in ("skip", "head", "full") and a["blocks"] > 0
        assert llm.adapter is llm.drafter.adapter
