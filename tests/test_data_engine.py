"""The self-distillation data engine (models/data_engine.py) on the real bundled target.

Batches under 64 rows run the batch-invariant kernels (patch 0004), so the engine's greedy answers
must be plain decoding's token for token and its feature rows the taps of a one-sequence decode."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import run_cli
from prompts import PROMPTS

LAYERS = [1, 15, 29]


def _prompts_file(tmp_path, n):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS[:n]))
    return p


def _run(smollm2_path, prompts, out, **kw):
    from blockspec.models.data_engine import EngineConfig, run_engine

    cfg = EngineConfig(**{**dict(n_prompts=4, n_parallel=3, max_new=12, shard_size=2, sample_frac=0.5,
                                 threads=1), **kw})
    return run_engine(smollm2_path, [str(prompts)], out, LAYERS, cfg, progress=False)


def _sequences(out):
    seqs = []
    for p in sorted(out.glob("shard_*.safetensors")):
        sh = load_file(str(p))
        off = np.concatenate([[0], np.cumsum(sh["lengths"])])
        for i in range(len(sh["lengths"])):
            seqs.append({k: (sh[k][off[i]:off[i + 1]] if sh[k].shape[0] == off[-1] else sh[k][i]) for k in sh})
    return sorted(seqs, key=lambda s: int(s["prompt_idx"]))


def test_answers_and_features_match_plain_decoding(smollm2_path, tmp_path):
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.llama.prompt import prompt_tokens
    from blockspec.runtime.llama.target import Target, TargetConfig

    out = tmp_path / "data"
    summary = _run(smollm2_path, _prompts_file(tmp_path, 4), out)
    assert summary["prompts"] == 4 and summary["shards"] == 2
    seqs = _sequences(out)
    assert [int(s["prompt_idx"]) for s in seqs] == [0, 1, 2, 3]
    assert {int(s["sampled"]) for s in seqs} == {0, 1}  # sample_frac 0.5 over 4 prompts (seeded)
    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_threads=1)) as t:
        t.enable_taps(LAYERS)
        for s in seqs:
            toks, a = s["tokens"].tolist(), int(s["answer_start"])
            assert toks[:a] == prompt_tokens(t, PROMPTS[int(s["prompt_idx"])])
            if not s["sampled"]:
                t.clear()
                plain = generate(t, toks[:a], max_tokens=12).tokens
                assert toks[a:] == plain
            # feature rows = taps of the same tokens decoded one sequence alone (f16 storage)
            t.clear()
            t.decode(toks[:-1], range(len(toks) - 1), logits=[True] * (len(toks) - 1))
            ref = np.concatenate([t.tap(lid) for lid in LAYERS], -1)
            got = s["feats"][:-1].astype(np.float32)
            scale = np.abs(ref).max(1, keepdims=True)
            assert np.abs(got - ref).max() <= 2e-3 * scale.max()
            # answer positions: the target's argmax and top-k log-probs (descending, normalised)
            rows = np.stack([t.logits_row(i) for i in range(a - 1, len(toks) - 1)])
            assert np.array_equal(s["greedy"][a - 1:-1], rows.argmax(-1))
            lp = s["top_logp"][a - 1:-1].astype(np.float32)
            assert np.all(np.diff(lp, axis=-1) <= 0) and np.all(lp <= 0)
            assert np.array_equal(s["top_ids"][a - 1:-1, 0], rows.argmax(-1))


def test_resume_after_interruption_and_full_disk(smollm2_path, tmp_path, monkeypatch):
    from blockspec.models import data_engine
    from blockspec.runtime.errors import BlockspecError

    prompts = _prompts_file(tmp_path, 6)
    out = tmp_path / "data"
    _run(smollm2_path, prompts, out, n_prompts=2)
    first = sorted(p.name for p in out.glob("shard_*"))
    (out / "shard_00009.tmp").write_bytes(b"cut short")  # a crash mid-write
    # the disk fills up: the run stops with one line, the shards written stay
    real = shutil.disk_usage
    monkeypatch.setattr(data_engine.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(BlockspecError, match="out of disk"):
        _run(smollm2_path, prompts, out, n_prompts=6)
    assert sorted(p.name for p in out.glob("shard_*")) == first
    monkeypatch.undo()
    # Ctrl-C mid-run: finished answers are written and summary.json says what the folder holds
    calls = {"n": 0}
    real_top_k = data_engine.top_k_logp

    def interrupt_late(*a, **k):
        calls["n"] += 1
        if calls["n"] > 6:  # a few decode steps in: three answers in flight
            raise KeyboardInterrupt
        return real_top_k(*a, **k)

    monkeypatch.setattr(data_engine, "top_k_logp", interrupt_late)
    with pytest.raises(KeyboardInterrupt):
        _run(smollm2_path, prompts, out, n_prompts=6)
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped"] and stopped["prompts"] == len(_sequences(out)) >= 2
    monkeypatch.undo()
    summary = _run(smollm2_path, prompts, out, n_prompts=6)
    assert summary["done_before"] == stopped["prompts"] and summary["prompts"] == 6 and not summary["stopped"]
    assert not list(out.glob("*.tmp"))
    assert [int(s["prompt_idx"]) for s in _sequences(out)] == list(range(6))
    with pytest.raises(BlockspecError, match="other settings"):
        _run(smollm2_path, prompts, out, n_prompts=6, max_new=13)


def test_trainer_reads_answers_only(smollm2_path, tmp_path):
    from blockspec.models.data import RaggedFeatures
    from blockspec.models.train import Batches

    out = tmp_path / "data"
    _run(smollm2_path, _prompts_file(tmp_path, 4), out)
    src = RaggedFeatures.load(out, [29, 1])
    # the shards are memory-mapped; a row is its shard's packed tokens, the chosen taps in the chosen
    # order, and past its end its last token's values
    from safetensors.numpy import load_file

    assert isinstance(src.shards[0]["feats"], np.memmap)
    shards = [load_file(str(p)) for p in sorted(out.glob("shard_*.safetensors"))]
    flat = {k: np.concatenate([sh[k] for sh in shards]) for k in ("tokens", "feats", "top_ids")}
    off = np.concatenate([[0], np.cumsum(src.lengths)[:-1]])
    H, have = src.meta["dim"], list(src.meta["layers"])
    tap = {lid: slice(have.index(lid) * H, (have.index(lid) + 1) * H) for lid in (29, 1)}
    idx = np.array([2, 0, 3])
    got = src.rows(idx)
    assert got["feats"].shape == (3, int(src.lengths[idx].max()), 2 * H)
    for r, i in enumerate(idx):
        n, seg = int(src.lengths[i]), slice(int(off[i]), int(off[i] + src.lengths[i]))
        assert np.array_equal(got["tokens"][r, :n], flat["tokens"][seg])
        assert np.array_equal(got["top_ids"][r, :n], flat["top_ids"][seg])
        assert np.array_equal(got["feats"][r, :n], np.concatenate([flat["feats"][seg, tap[29]],
                                                                  flat["feats"][seg, tap[1]]], -1))
        assert (got["tokens"][r, n:] == flat["tokens"][seg.stop - 1]).all()
    batches = Batches(src, 4, 0.25, seed=0)
    assert np.array_equal(batches.lo, src.answer_start - 1)
    rows = np.random.default_rng(7).choice(batches.split["train"], size=6, p=batches.row_p["train"])
    b = batches.get_batch("train", 6, 5, rng=np.random.default_rng(7))
    anc = b["anchors"].numpy()
    assert (anc >= batches.lo[rows][:, None]).all() and (anc <= src.lengths[rows][:, None] - 2).all()
    # `last` is the answer token after the anchor; labels are the target's argmax there
    for i, r in enumerate(rows):
        seq = src.rows(np.array([r]))
        assert np.array_equal(b["last"][i].numpy(), seq["tokens"][0, anc[i] + 1])
        assert np.array_equal(b["labels"][i, :, 0].numpy(), seq["greedy"][0, anc[i] + 1])
    counts = src.label_counts(src.meta["vocab_size"])
    assert counts.sum() == sum(int(n - a) for n, a in zip(src.lengths, src.answer_start))


def test_serve_anchors_follow_the_walk(smollm2_path, tmp_path):
    """`train --serve-anchors`: the training blocks are anchored where the serving walk drafts (each
    anchor the previous one plus its accepted prefix plus one, from the answer's start), the walk is
    saved once and read back, and the held-out estimate keeps its uniform anchors."""
    import torch

    from blockspec.models.data import RaggedFeatures
    from blockspec.models.target import load_target
    from blockspec.models.train import Batches, load_drafter, serve_anchors, walk_acceptance, walk_row
    from blockspec.runtime.engine.setup import shipped_drafter

    out = tmp_path / "data"
    _run(smollm2_path, _prompts_file(tmp_path, 4), out, max_new=24)
    model, _ = load_drafter(shipped_drafter("specblock"), load_target(str(smollm2_path)))
    src = RaggedFeatures.load(out, list(model.args.target_layers))
    batches = Batches(src, model.args.n_predict, 0.25, seed=0)
    rows = batches.split["train"]
    sets = serve_anchors(model, batches, rows, tmp_path / "serve_anchors.npz", progress=False)
    hist = np.zeros(model.args.n_predict + 1, np.int64)
    for r in rows.tolist():
        anc, ks = walk_row(model, batches, r)
        assert np.array_equal(sets[r], anc) and anc[0] == batches.lo[r]
        assert np.array_equal(anc[1:], anc[:-1] + ks[:-1] + 1) and anc[-1] <= src.lengths[r] - 3
        hist += np.bincount(ks, minlength=len(hist))
    hist[0] += len(rows)  # the prefills
    assert walk_acceptance(model, batches, rows)["accept_hist"] == hist.tolist()
    again = serve_anchors(None, batches, rows, tmp_path / "serve_anchors.npz")  # read back, nothing walked
    assert all(np.array_equal(again[r], sets[r]) for r in rows.tolist())
    batches.train_anchors = sets
    b = batches.get_batch("train", 6, 8, rng=np.random.default_rng(3))
    rows_drawn = np.random.default_rng(3).choice(rows, size=6, p=batches.row_p["train"])
    for r, anc in zip(rows_drawn.tolist(), b["anchors"].numpy()):
        assert set(anc.tolist()) <= set(sets[r].tolist())
    held = batches.get_batch("heldout", 2, 16, rng=np.random.default_rng(3))["anchors"]
    batches.train_anchors = None
    assert torch.equal(held, batches.get_batch("heldout", 2, 16, rng=np.random.default_rng(3))["anchors"])

def test_caches_read_together(smollm2_path, tmp_path):
    """`--data A,B`: two runs read as one cache, in order, each holding out its own prompts; a
    cache of other taps is refused with one line naming what differs."""
    from blockspec.models.data import RaggedFeatures, open_feature_cache
    from blockspec.models.data_engine import EngineConfig, run_engine
    from blockspec.models.train import Batches

    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS[4:7]))
    _run(smollm2_path, _prompts_file(tmp_path, 4), tmp_path / "a")
    _run(smollm2_path, other, tmp_path / "b", n_prompts=3)
    a, b = RaggedFeatures.load(tmp_path / "a", [1, 29]), RaggedFeatures.load(tmp_path / "b", [1, 29])
    ab = open_feature_cache(f"{tmp_path / 'a'},{tmp_path / 'b'}", [1, 29])
    assert np.array_equal(ab.lengths, np.concatenate([a.lengths, b.lengths]))
    assert np.array_equal(ab.prompt_idx, np.concatenate([a.prompt_idx, b.prompt_idx]))
    for i in range(len(ab.lengths)):
        one, j = (a, i) if i < len(a.lengths) else (b, i - len(a.lengths))
        for k, v in ab.rows(np.array([i])).items():
            assert np.array_equal(v, one.rows(np.array([j]))[k])
    held = Batches(ab, 4, 0.5, seed=0).split["heldout"]  # every 2nd prompt of each run, greedy answers
    assert np.array_equal(held, np.flatnonzero((ab.prompt_idx % 2 == 0) & ~ab.sampled)) and len(held)
    run_engine(smollm2_path, [str(other)], tmp_path / "c", [1, 29],
               EngineConfig(n_prompts=1, n_parallel=1, max_new=4, threads=1), progress=False)
    with pytest.raises(ValueError, match="layers"):
        open_feature_cache(f"{tmp_path / 'a'},{tmp_path / 'c'}")


def test_bad_prompts_file_names_the_line(smollm2_path, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hello"}\n{"prompt": \n')
    r = run_cli("train", "data", "--target", str(smollm2_path), "--prompts", str(bad), "--out",
                str(tmp_path / "o"), "--n-prompts", "2", "--threads", "1")
    assert r.returncode != 0
    assert f"{bad}:2" in r.stderr.strip().splitlines()[-1]


def test_workers_split_the_prompts(smollm2_path, tmp_path, monkeypatch):
    from blockspec.models import data_engine

    prompts, out, other = _prompts_file(tmp_path, 5), tmp_path / "data", tmp_path / "other"
    _run(smollm2_path, prompts, other, n_prompts=5, worker=1, workers=2, max_new=4)
    save = data_engine.save_shard

    def while_running(*a, **kw):  # worker 1 writes its shards while worker 0 runs
        for p in other.glob("shard_w1_*"):
            if not (out / p.name).exists():
                shutil.copy(p, out / p.name)
        return save(*a, **kw)

    monkeypatch.setattr(data_engine, "save_shard", while_running)
    summary = _run(smollm2_path, prompts, out, n_prompts=5, worker=0, workers=2, max_new=4)
    seqs = _sequences(out)
    names = sorted(p.name for p in out.glob("shard_*"))
    assert names[0].startswith("shard_w0_") and names[-1].startswith("shard_w1_")
    assert [int(s["prompt_idx"]) for s in seqs] == list(range(5))
    # the summary is the folder's, the other worker's shards written during the run included
    assert summary["prompts"] == len(seqs) and summary["shards"] == len(names)
    assert summary["answer_tokens"] == sum(int(s["lengths"] - s["answer_start"]) for s in seqs)
    assert summary["new_answer_tokens"] < summary["answer_tokens"]
    # a single-process rerun over the same cache finds everything done
    monkeypatch.undo()
    assert _run(smollm2_path, prompts, out, n_prompts=5, max_new=4)["done_before"] == 5

def test_eval_set_is_answered_but_never_trained_on(smollm2_path, tmp_path):
    from blockspec.models.data_engine import EngineConfig, prompt_source_names, run_engine
    from blockspec.models.train import TrainConfig, evaluate_drafter, feature_source
    from blockspec.runtime.engine.setup import shipped_drafter
    from blockspec.runtime.errors import BlockspecError
    from blockspec.runtime.format.gguf_header import GGUFHeader

    with pytest.raises(BlockspecError, match="never training data"):
        _run(smollm2_path, "mtbench", tmp_path / "train")
    assert not (tmp_path / "train").exists()
    out = tmp_path / "eval"
    drafter = shipped_drafter("specblock")
    layers = [int(x) for x in GGUFHeader(drafter, keep=("specblock.target_layers",)).fields["specblock.target_layers"]]
    cfg = EngineConfig(n_prompts=3, n_parallel=3, max_new=12, sample_frac=0.5, threads=1, eval_set=True)
    s = run_engine(smollm2_path, ["mtbench", "humaneval"], out, layers, cfg, progress=False)
    assert s["eval_dropped"] == 0 and json.loads((out / "meta.json").read_text())["eval_set"]
    assert not any(bool(q["sampled"]) for q in _sequences(out))  # greedy: what the estimate predicts
    with pytest.raises(BlockspecError, match="evaluation set"):
        feature_source(TrainConfig(method="specblock", data=str(out)), None, layers)
    # scored on every prompt, and per source: round-robin order, mtbench first
    assert prompt_source_names(["mtbench", "humaneval"], 3) == ["mtbench", "humaneval", "mtbench"]
    est = evaluate_drafter(drafter, str(out), str(smollm2_path), n_batches=2, by_source=prompt_source_names)
    assert est["heldout_prompts"] == 3
    assert {k: v["heldout_prompts"] for k, v in est["by_source"].items()} == {"mtbench": 2, "humaneval": 1}
    taus = list(est["tau_by_block"].values())
    assert list(est["tau_by_block"]) == [1, 2, 4] and taus == sorted(taus) and taus[-1] == est["tau"]
    # serving replayed: every answer token produced once, by the prefill's pass (1) or a pass accepting k (k + 1),
    # where an answer's last pass may end one token past it (its bonus token lies beyond --max-new or the EOS)
    est = evaluate_drafter(drafter, str(out), str(smollm2_path), n_batches=2, by_source=prompt_source_names,
                           walk=True, n_prompts=2)
    assert {k: v["heldout_prompts"] for k, v in est["by_source"].items()} == {"mtbench": 1, "humaneval": 1}
    seqs = [q for q in _sequences(out) if int(q["prompt_idx"]) < 2]
    w = est["walk"]
    assert w["tokens"] == sum(int(q["lengths"] - q["answer_start"]) for q in seqs)
    made = sum(n * (k + 1) for k, n in enumerate(w["accept_hist"]))
    assert w["tokens"] <= made <= w["tokens"] + len(seqs)
    assert w["passes"] == sum(w["accept_hist"]) and w["accept_hist"][0] >= len(seqs)
    assert w["tokens"] == sum(v["walk"]["tokens"] for v in est["by_source"].values())


def test_estimate_needs_held_out_greedy_answers(smollm2_path, tmp_path):
    """The estimate predicts greedy serving, so it reads held-out prompts' greedy answers only: on a
    cache whose every answer is sampled, `train eval` stops with one line (not a numpy traceback),
    and a missing cache in a comma-separated --data is named."""
    from blockspec.runtime.engine.setup import shipped_drafter

    out = tmp_path / "sampled"
    _run(smollm2_path, _prompts_file(tmp_path, 2), out, n_prompts=2, max_new=4, sample_frac=1.0)
    for data, why in [(str(out), "no held-out greedy answers"), (f"{out},{tmp_path / 'none'}", "no feature cache")]:
        r = run_cli("train", "eval", "--drafter", shipped_drafter("specblock"), "--data", data,
                    "--target", str(smollm2_path), "--batches", "1")
        assert r.returncode != 0 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_code_sources_never_repeat_a_function():
    """`pycode-more` continues `pycode` (which keeps its 1,586 prompts, so the recorded `pycode:N`
    runs still name the same prompts): none of its prompts is one of `pycode`'s."""
    from blockspec.models import data

    first = [m[0]["content"] for m in data.SOURCES["pycode"]()]
    more = [m[0]["content"] for m in data.SOURCES["pycode-more"]()]
    assert len(first) == 1586 and len(more) > 1000  # the recorded runs' counts on Python 3.11
    assert not set(first) & set(more)


def test_prompt_length_window(smollm2_path, tmp_path):
    """--min-prompt / --max-prompt answer exactly the prompts whose templated length is in the
    window (a later run takes what an earlier --max-prompt skipped) and count the rest."""
    prompts = _prompts_file(tmp_path, 5)
    _run(smollm2_path, prompts, tmp_path / "all", n_prompts=5, max_new=2)
    n_prompt = {int(s["prompt_idx"]): int(s["answer_start"]) for s in _sequences(tmp_path / "all")}
    lo = sorted(n_prompt.values())[2]
    s = _run(smollm2_path, prompts, tmp_path / "long", n_prompts=5, max_new=2, min_prompt=lo)
    assert [int(q["prompt_idx"]) for q in _sequences(tmp_path / "long")] == \
        sorted(i for i, n in n_prompt.items() if n >= lo)
    assert s["too_short"] == sum(n < lo for n in n_prompt.values())
    # settings that no prompt can meet, or another window over the same cache: one clear line
    from blockspec.runtime.errors import BlockspecError
    with pytest.raises(BlockspecError, match="--min-prompt"):
        _run(smollm2_path, prompts, tmp_path / "none", min_prompt=300, max_prompt=256)
    with pytest.raises(BlockspecError, match="min_prompt"):
        _run(smollm2_path, prompts, tmp_path / "long", n_prompts=5, max_new=2, min_prompt=lo + 1)


def test_later_turn_sources_ask_the_second_question():
    """`sharegpt-turn2` asks each ShareGPT conversation its second question after the first exchange
    (conversations with one question are skipped), `SOURCE:N` still counts records, and sources of
    different turns in one run each ask their own turn."""
    import itertools

    from blockspec.models import data
    from blockspec.models.data_engine import iter_prompts

    convs = list(itertools.islice(data.SOURCES["sharegpt"](), 40))
    want = []
    for c in convs:
        users = [i for i, m in enumerate(c) if m["role"] == "user"]
        if len(users) >= 2:
            want.append([{"role": m["role"], "content": m["content"]} for m in c[:users[1] + 1]])
    got = list(itertools.islice(iter_prompts(["sharegpt-turn2"]), len(want)))
    assert want and got == want
    assert all(p[-1]["role"] == "user" and any(m["role"] == "assistant" for m in p) for p in got)
    assert list(itertools.islice(iter_prompts(["sharegpt-turn2:40"]), 1))[0] not in want
    # several turns in one run: each source asks its own turn (a late-bound turn once made every
    # source ask the last one's, so a turn-3..8 run asked the same eighth questions six times)
    mixed = list(itertools.islice(iter_prompts(["sharegpt-turn2", "sharegpt-turn3"]), 2 * len(want)))
    assert [sum(m["role"] == "user" for m in p) for p in mixed[:6]] == [2, 3] * 3
    assert mixed[0] == want[0]
