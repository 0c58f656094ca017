"""`blockspec train prompts`: questions the real SmolLM2 writes after its chat template's user-turn
prefix, as a prompts JSONL `train data` reads; duplicates and evaluation prompts dropped and counted;
resumable after a torn line; a foreign file refused in one line."""

import json

import pytest

from blockspec.models import data
from blockspec.models.data import _norm
from blockspec.models.data_engine import iter_prompts
from blockspec.models.self_prompts import generate_prompts, user_turn_prefix
from blockspec.runtime.errors import BlockspecError

OPTS = dict(n_parallel=4, max_new=48, threads=1, progress=False)


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_target_writes_prompts_train_data_reads(smollm2_path, tmp_path, monkeypatch):
    from blockspec.runtime.llama.target import Target, TargetConfig

    with Target(smollm2_path, TargetConfig(n_threads=1)) as t:  # the system turn, then the user's turn opens
        toks = user_turn_prefix(t)
        turn = t.tokenize("<|im_end|>\n<|im_start|>user\n", add_special=False, parse_special=True)
        assert toks[-len(turn):] == turn and t.detokenize(toks).startswith("system\n")

    out = tmp_path / "p.jsonl"
    s = generate_prompts(smollm2_path, out, 6, **OPTS)
    rows = _lines(out)
    assert s["prompts"] == len(rows) == 6 and s["new"] == 6
    assert len({_norm(r["prompt"]) for r in rows}) == 6 and all(r["prompt"].strip() == r["prompt"] != "" for r in rows)
    assert [m[0]["content"] for m in iter_prompts([str(out)])] == [r["prompt"] for r in rows]

    # a crash mid-line: the torn line is dropped, the run continues with later attempts
    with open(out, "a") as f:
        f.write('{"prompt": "torn')
    s = generate_prompts(smollm2_path, out, 8, **OPTS)
    again = _lines(out)
    assert s["done_before"] == 6 and len(again) == 8 and again[:6] == rows
    assert min(r["attempt"] for r in again[6:]) > max(r["attempt"] for r in rows)
    assert generate_prompts(smollm2_path, out, 8, **OPTS)["new"] == 0  # done: nothing loaded or written

    # an evaluation prompt is never written: the same seed's first question, banned, is dropped and counted
    monkeypatch.setattr(data, "eval_prompts", lambda: {_norm(rows[0]["prompt"])})
    s = generate_prompts(smollm2_path, tmp_path / "q.jsonl", 6, **OPTS)
    assert s["eval_dropped"] >= 1 and rows[0]["prompt"] not in [r["prompt"] for r in _lines(tmp_path / "q.jsonl")]


def test_foreign_file_is_refused(smollm2_path, tmp_path):
    out = tmp_path / "mine.jsonl"
    out.write_text('{"prompt": "a prompts file of my own"}\n')
    with pytest.raises(BlockspecError, match="not a `train prompts` file"):
        generate_prompts(smollm2_path, out, 2, **OPTS)
    assert out.read_text() == '{"prompt": "a prompts file of my own"}\n'  # untouched
