"""The answer store (runtime/drafters/store.py): the target's own answers as a second place the n-gram
lookup drafts from. Its drafts are deterministic, so output stays plain decoding's, greedy and sampled;
a store refuses another target; `blockspec train store` writes it from self-distilled caches."""

from __future__ import annotations

import json
import struct
from collections import Counter

import numpy as np
import pytest

from conftest import run_cli
from prompts import PROMPTS

from blockspec.runtime.drafters.ngram import NgramDrafter
from blockspec.runtime.drafters.store import SEP, AnswerStore, draft_kind, load_store, save_store
from blockspec.runtime.engine.generate import generate
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.engine.setup import make_drafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.llama.prompt import prompt_tokens


def _store(*answers, fp=None, **kw):
    return AnswerStore(np.array([t for a in answers for t in (*a, SEP)], np.int32), fp or {}, **kw)


def test_longest_suffix_and_the_majority_continuation():
    s = _store([1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 3, 4, 6, 8], [3, 4, 6, 8, 1])
    # "2 3 4" occurs twice, followed by 5 and by 6: a tie goes to the smaller token id
    assert s.propose([0, 2, 3, 4], 3) == ([5], 3, 0.5)
    # "3 4" alone (not after 2): four occurrences, three continue with 6 then 8
    path, n, share = s.propose([0, 3, 4], 3)
    assert (path, n, share) == ([6, 8, 1], 2, 0.75)
    # a continuation stops at the end of an answer: the whole second answer matches, but nothing
    # follows it, so the store backs off to "3 4 6" (three occurrences, two go on with 8, then 1)
    assert s.propose([9, 2, 3, 4, 6], 4) == ([8, 1], 3, pytest.approx(2 / 3))
    # a suffix seen nowhere drafts nothing
    assert s.propose([42, 43], 4) == ([], 0, 0.0)
    assert s.propose([5], 4) == ([], 0, 0.0)  # shorter than the shortest suffix looked up
    assert s.propose([0, 3, 4], 16) == ([6, 8, 1], 2, 0.75)  # a block longer than any answer


def test_no_window_spans_two_answers():
    s = _store([1, 2], [3, 4])
    assert s.propose([2, 3], 2) == ([], 0, 0.0)  # "2 | 3" is not in the text
    assert s.propose([1, 2], 2) == ([], 0, 0.0)  # 2 ends its answer: nothing follows it


def test_roundtrip_and_fingerprint(tmp_path, smollm2_path):
    from blockspec.runtime.format.drafter_gguf import target_fingerprint

    fp = target_fingerprint(smollm2_path)
    path = tmp_path / "s.gguf"
    tokens = np.array([5, 6, 7, SEP, 5, 6, 8, SEP], np.int32)
    save_store(path, tokens, fp, {"2,1": 0.4}, {"data": ["x"]})
    s = load_store(path)
    assert s.n_answers == 2 and len(s) == 6 and s.calibration == {"2,1": 0.4}
    assert s.fits(fp) is None
    assert s.prior(("store", 2, 1)) == 0.4 and s.prior(("store", 4, 2)) == 0.5
    assert "another target" in s.fits({**fp, "tokenizer_sha256": "0" * 64})
    with pytest.raises(BlockspecError, match="not an answer store"):
        load_store(smollm2_path)
    with pytest.raises(BlockspecError, match="does not exist"):
        load_store(tmp_path / "missing.gguf")
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:40])
    with pytest.raises(BlockspecError, match="truncated or corrupt"):
        load_store(tmp_path / "cut.gguf")


def test_kinds_by_suffix_length_and_vote_share():
    assert draft_kind(2, 0.2) == ("store", 2, 0)
    assert draft_kind(3, 0.5) == ("store", 3, 1)
    assert draft_kind(8, 0.95) == ("store", 4, 2)


def _plain(target, prompt, temperature=0.0, n=64, seed=7):
    return generate(target, prompt, max_tokens=n, sampling=SamplingParams(temperature=temperature, seed=seed))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_store_drafts_and_output_is_plains(smollm2, smollm2_path, temperature):
    """A store holding the target's own greedy answers to other prompts (and to this one with its tail
    changed, so drafts are rejected too): the lookup drafts from it, output equals plain decoding."""
    from blockspec.runtime.format.drafter_gguf import target_fingerprint

    prompts = [prompt_tokens(smollm2, p) for p in PROMPTS[:4]]
    answers = [_plain(smollm2, p, n=48).tokens for p in prompts[1:]]
    own = _plain(smollm2, prompts[0], n=64).tokens
    answers.append(own[:30] + [t + 1 for t in own[30:]])
    store = AnswerStore(np.array([t for a in answers for t in (*a, SEP)], np.int32),
                        target_fingerprint(smollm2_path))
    d = NgramDrafter(block_size=4, store=store)
    plain = _plain(smollm2, prompts[0], temperature)
    spec = generate(smollm2, prompts[0], max_tokens=64, drafter=d,
                    sampling=SamplingParams(temperature=temperature, seed=7))
    assert spec.tokens == plain.tokens
    assert d.store_matches > 0, "the store never drafted"
    if temperature == 0:
        assert spec.stats.target_passes < plain.stats.target_passes


def test_another_targets_store_is_refused(smollm2, smollm2_path, tmp_path):
    from blockspec.runtime.format.drafter_gguf import target_fingerprint

    fp = {**target_fingerprint(smollm2_path), "n_vocab": 32000}
    path = tmp_path / "other.gguf"
    save_store(path, np.array([1, 2, 3, SEP], np.int32), fp, {}, {})
    d = make_drafter("ngram", str(path), block_size=4)
    with pytest.raises(BlockspecError, match="answers of another target"):
        d.check_target(smollm2)
    assert make_drafter("ngram", block_size=4).store is None  # the store is used only where named


def _cache(smollm2_path, tmp_path, name="cache", **kw):
    from blockspec.models.data_engine import EngineConfig, run_engine

    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS[:6]))
    cfg = EngineConfig(**{**dict(n_prompts=6, n_parallel=3, max_new=24, shard_size=3, sample_frac=0.0,
                                 threads=1), **kw})
    out = tmp_path / name
    run_engine(smollm2_path, [str(p)], out, [29], cfg, progress=False)
    return out


def test_train_store_cli(smollm2_path, tmp_path):
    """`blockspec train store`: every answer with its template header, a calibration from the held-out
    ones, and the GGUF the runtime loads; the method follows from the file; an evaluation set and a
    non-cache are refused with one line."""
    from blockspec.runtime.engine.setup import default_method

    cache = _cache(smollm2_path, tmp_path)
    out = tmp_path / "store.gguf"
    r = run_cli("train", "store", "--data", str(cache), "--target", str(smollm2_path), "--out", str(out),
                "--heldout", "2")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["answers"] == 6 and res["heldout_replay"]["passes"] > 0
    s = load_store(out)
    assert s.n_answers == 6 and len(s) == res["tokens"]
    assert default_method(str(smollm2_path), str(out)) == "ngram"
    r = run_cli("train", "store", "--data", str(tmp_path), "--target", str(smollm2_path), "--out",
                str(tmp_path / "x.gguf"))
    assert r.returncode != 0 and "no feature cache there" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.gguf").exists()


def test_static_lookup_cache_counts_every_bigram(tmp_path, smollm2_path, monkeypatch):
    """Upstream's llama-lookup peer reads the same answers as its static cache: every 2-gram inside an
    answer with the counts of the token after it, in common/ngram-cache.cpp's file layout."""
    from blockspec.runtime.bench.peers import static_lookup_cache
    from blockspec.runtime.format.drafter_gguf import target_fingerprint

    monkeypatch.setenv("BLOCKSPEC_CACHE", str(tmp_path / "cache"))
    answers = [[1, 2, 3, 1, 2, 4], [1, 2, 3, 5]]
    path = tmp_path / "s.gguf"
    save_store(path, np.array([t for a in answers for t in (*a, SEP)], np.int32),
               target_fingerprint(smollm2_path), {}, {})
    buf = static_lookup_cache(path).read_bytes()
    got, off = {}, 0
    while off < len(buf):
        a, b, c, d, n = struct.unpack_from("<4ii", buf, off)
        off += 20
        pairs = np.frombuffer(buf, np.int32, 2 * n, off).reshape(n, 2)
        off += 8 * n
        assert (c, d) == (-1, -1)
        got[(a, b)] = Counter({int(t): int(k) for t, k in pairs})
    want: dict = {}
    for ans in answers:
        for i in range(len(ans) - 2):
            want.setdefault((ans[i], ans[i + 1]), Counter())[ans[i + 2]] += 1
    assert got == want
