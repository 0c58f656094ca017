"""Torch block drafters (SpecBlock chain/tree, DBlast branches) in the runtime engine, on the bundled
SmolLM2: greedy speculative output equals plain output, the drafter's incremental context equals a
recompute, and mismatched or missing drafters fail with one line.

The checkpoints are random-weight drafters written here the way models/train.py saves them; random
drafts are mostly rejected, so each mode also runs with the target's own continuation (cut at a
varying depth) merged into the drafter's tree, which exercises accepted rows in observe/commit.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.engine.setup import make_drafter
from blockspec.runtime.drafters.torch_backend import TorchDrafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.llama.target import Target, TargetConfig
from blockspec.runtime.drafters.tree import DraftTree

from conftest import run_cli
from prompts import PROMPTS

torch = pytest.importorskip("torch")

GREEDY = SamplingParams(temperature=0.0)
N_NEW = 64
SMOL = dict(dim=576, target_dim=576, n_head=9, n_kv_head=3, head_dim=64, ffn_dim=1536, vocab_size=49152)


def write_checkpoint(out: Path, seed: int = 0, **model_args) -> Path:
    """A random-weight drafter checkpoint dir (drafter.safetensors + drafter.json with model_args)."""
    from safetensors.torch import save_file

    from blockspec.models import build_model

    torch.manual_seed(seed)
    model = build_model(model_args)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out / "drafter.safetensors"))
    (out / "drafter.json").write_text(json.dumps(dict(model_args=dataclasses.asdict(model.args), step=0)))
    return out


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    # a reduced draft vocabulary keeps the random drafter's head (and the test) cheap
    common = dict(SMOL, n_layer=1, draft_vocab_size=2048)
    return {
        "specblock": write_checkpoint(root / "specblock", model_type="specblock", block_size=4,
                                      target_layers=[1, 15, 29], **common),
        "dblast": write_checkpoint(root / "dblast", model_type="dblast", block_size=5, n_categories=3,
                                   target_layers=[1, 8, 15, 22, 29], **common),
    }


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_seq_max=16)) as t:
        yield t


@pytest.fixture(scope="module")
def plain(target):
    out = {}
    for i in (0, 5):
        prompt = prompt_tokens(target, PROMPTS[i])
        out[i] = (prompt, generate(target, prompt, max_tokens=N_NEW, sampling=GREEDY).tokens)
    return out


class WithOracle(Drafter):
    """The inner drafter's tree plus the target's greedy continuation cut at a depth that cycles
    0..block: the engine must accept the oracle part and feed the inner drafter those rows."""

    def __init__(self, inner, continuation, start: int, block: int = 4):
        self.inner, self.cont, self.start, self.block = inner, continuation, start, block
        self.name, self.backend, self.target_layers = inner.name, inner.backend, inner.target_layers
        self.max_nodes = inner.max_nodes + block
        self.max_leaves = inner.max_leaves + 1
        self.steps = 0

    def check_target(self, target):
        self.inner.check_target(target)

    def trim(self, n):
        self.inner.trim(n)

    def held_prefix(self, tokens):
        return self.inner.held_prefix(tokens)

    def observe(self, tokens, start, feats):
        self.inner.observe(tokens, start, feats)

    def propose(self, history, sampler=None):
        tree = self.inner.propose(history, sampler)  # also checks the inner drafter is in step
        at = len(history) - self.start
        depth = self.steps % (self.block + 1)
        self.steps += 1
        paths = [self.cont[at: at + depth]]
        paths += [[tree.tokens[i] for i in tree.path(leaf)[1:]] for leaf in tree.leaves() if leaf]
        return DraftTree.from_paths(tree.tokens[0], [p for p in paths if p])


MODES = {
    "specblock-chain": ("specblock", 1),
    "specblock-tree": ("specblock", 2),  # rank-head tree of up to 4 * 2 nodes
    "dblast-branches": ("dblast", 3),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_speculative_equals_plain(target, ckpts, plain, mode):
    method, branches = MODES[mode]
    taus = []
    for k, (i, oracle) in enumerate([(0, False), (5, True)]):
        prompt, want = plain[i]
        d = make_drafter(method, str(ckpts[method]), None, block_size=4, branches=branches)
        assert d.backend == "torch" and d.name == method
        if oracle:
            d = WithOracle(d, want, len(prompt))
        spec = generate(target, prompt, max_tokens=N_NEW, sampling=GREEDY, drafter=d)
        assert spec.tokens == want, f"{mode} prompt {i}: diverged at " \
            f"{next(j for j, (a, b) in enumerate(zip(spec.tokens, want)) if a != b)}"
        taus.append(spec.stats.tau)
        if oracle:
            _check_rows_against_fresh_prefill(target, d.inner, prompt + spec.tokens[:-1])
    assert taus[1] > 1.5  # the oracle's part was accepted
    print(f"\n{mode}: tau {taus}")


def _check_rows_against_fresh_prefill(target, d, seq):
    """The rows the engine fed the drafter (prefill chunks, then root + accepted rows of each tree
    pass) are those of the committed tokens: a drafter fed one fresh prefill's taps agrees."""
    assert d.tokens == seq
    fresh = TorchDrafter.load(d.path)
    fresh.check_target(target)
    target.clear()
    target.enable_taps(fresh.target_layers)
    for s in range(0, len(seq), 32):  # < 64 rows a batch: the same attention kernel as verification
        chunk = seq[s:s + 32]
        target.decode(chunk, range(s, s + len(chunk)))
        fresh.observe(chunk, s, {lid: target.tap(lid) for lid in fresh.target_layers})
    target.clear()
    torch.testing.assert_close(d.cache.cond, fresh.cache.cond, rtol=1e-3, atol=1e-3)
    for a, b in zip(d.cache.k, fresh.cache.k):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_specblock_tree_shape(target, ckpts):
    d = make_drafter("specblock", str(ckpts["specblock"]), "torch", block_size=4, branches=3)
    d.check_target(target)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 49152, size=12).tolist()
    d.observe(toks[:-1], 0, {lid: rng.standard_normal((11, 576)).astype(np.float32) for lid in d.target_layers})
    tree = d.propose(toks)
    assert 1 <= len(tree) - 1 <= d.max_nodes and len(tree.leaves()) <= d.max_leaves
    assert max(tree.depths()) <= 4 and tree.tokens[0] == toks[-1]
    assert len(tree.leaves()) > 1  # this random rank head asks for width > 1 somewhere
    chain = make_drafter("specblock", str(ckpts["specblock"]), "torch", block_size=3)
    assert chain.max_nodes == 3 and chain.max_leaves == 1


@pytest.mark.parametrize("method", ["specblock", "dblast"])
def test_incremental_context_equals_recompute(target, ckpts, method):
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 49152, size=40).tolist()
    feats = {lid: rng.standard_normal((40, 576)).astype(np.float32) for lid in (1, 8, 15, 22, 29)}
    rows = lambda a, b: {lid: f[a:b] for lid, f in feats.items()}  # noqa: E731
    inc = make_drafter(method, str(ckpts[method]), "torch", block_size=4, branches=3)
    inc.check_target(target)
    # prefill chunks, a rejected step's rows, a rollback, then committed steps
    inc.observe(toks[:17], 0, rows(0, 17))
    inc.observe(toks[17:20], 17, rows(17, 20))
    inc.observe([99, 98, 97], 20, rows(30, 33))  # rows later rolled back
    inc.trim(20)
    inc.observe(toks[20:22], 20, rows(20, 22))
    inc.observe(toks[22:26], 22, rows(22, 26))
    fresh = make_drafter(method, str(ckpts[method]), "torch", block_size=4, branches=3)
    fresh.check_target(target)
    fresh.observe(toks[:26], 0, rows(0, 26))
    assert inc.tokens == fresh.tokens == toks[:26]
    for a, b in zip(inc.cache.k + inc.cache.v + [inc.cache.cond], fresh.cache.k + fresh.cache.v + [fresh.cache.cond]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    t_inc, t_fresh = inc.propose(toks[:27]), fresh.propose(toks[:27])
    assert (t_inc.tokens, t_inc.parents) == (t_fresh.tokens, t_fresh.parents)
    with pytest.raises(RuntimeError, match="out of step"):
        inc.propose(toks[:29])


@pytest.mark.parametrize("bad,words", [
    (dict(vocab_size=1000), "vocabulary of 1000"),
    (dict(dim=64, target_dim=64, n_head=4, n_kv_head=2, head_dim=16, ffn_dim=128), "width"),
    (dict(target_layers=[1, 15, 40]), "[40] out of range"),
])
def test_mismatched_drafter_refused_with_one_line(target, tmp_path, bad, words):
    args = {**SMOL, "n_layer": 1, "draft_vocab_size": 0, "target_layers": [1, 15, 29], **bad}
    path = write_checkpoint(tmp_path / "bad", model_type="specblock", **args)
    d = make_drafter("specblock", str(path), "torch")
    prompt = target.tokenize("Hello", add_special=True)
    with pytest.raises(BlockspecError) as e:
        generate(target, prompt, max_tokens=4, sampling=GREEDY, drafter=d)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_make_drafter_errors(tmp_path, ckpts, monkeypatch):
    import blockspec.runtime.engine.setup as drafters

    monkeypatch.setattr(drafters, "shipped_drafter", lambda method: None)  # as for a target with none
    with pytest.raises(BlockspecError, match=r"--method specblock needs --drafter PATH"):
        make_drafter("specblock", None)
    monkeypatch.undo()
    with pytest.raises(BlockspecError, match="does not exist"):
        make_drafter("dblast", str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BlockspecError, match="not a drafter checkpoint"):
        make_drafter("dblast", str(tmp_path / "empty"))
    with pytest.raises(BlockspecError, match="the ggml backend runs GGUF drafters"):
        make_drafter("specblock", str(ckpts["specblock"]), "ggml")
    with pytest.raises(BlockspecError, match="is a specblock checkpoint, not dblast"):
        make_drafter("dblast", str(ckpts["specblock"]))


def test_shipped_drafter_is_refused_by_another_target(tmp_path):
    """`--method specblock` without --drafter takes the drafter shipped for the bundled model; a
    different target refuses it at load in one line naming the mismatch."""
    from blockspec.models.target import ModelArgs
    from fixtures_target import write_tiny_gguf
    from blockspec.runtime.engine.setup import shipped_drafter
    from blockspec.runtime.format.modelfile import bundled_model_path

    assert shipped_drafter("specblock") and shipped_drafter("dblast")
    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny, ModelArgs(arch="llama", dim=64, n_layer=2, n_head=4, n_kv_head=2, head_dim=16,
                                    ffn_dim=128, vocab_size=49152), tokenizer_from=bundled_model_path())
    r = run_cli("generate", "hi", "--method", "specblock", "--model", str(tiny), "--max-tokens", "4", timeout=120)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("blockspec: error:") and "width" in lines[0], r.stderr