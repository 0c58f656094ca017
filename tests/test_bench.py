"""`blockspec bench`: the CLI end to end on the bundled model (smoke), prompt sets, method parsing,
and (heavy) upstream llama.cpp's own tools as peers."""

from __future__ import annotations

import json

import pytest

from blockspec.runtime.bench.run import METHODS, load_prompts, parse_drafters, parse_methods, speed_ratio_ci
from blockspec.runtime.errors import BlockspecError

from conftest import run_cli

RUN_KEYS = {"method", "temperature", "n_prompts", "n_tokens", "tau", "tokens_per_s", "speedup_vs_plain",
            "draft_fraction", "draft_cost", "lossless", "accept_hist"}
MACHINE_KEYS = {"cpu", "cores", "threads", "llama_cpp_build", "backend", "python", "torch", "date"}


def _prompts_file(tmp_path, n=2):
    rows = [{"prompt": "Repeat after me three times: the red fox runs, the red fox runs."},
            {"messages": [{"role": "user", "content": "List the numbers from one to ten in words."}]}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:n]) + "\n")
    return path


def test_bench_smoke(tmp_path):
    prompts = _prompts_file(tmp_path)
    out_json, out_png = tmp_path / "out" / "bench.json", tmp_path / "out" / "bench.png"
    res = run_cli("bench", "--prompts", str(prompts), "--methods", "plain,ngram,specblock,ngram-upstream-kernels,specblock-pilot",
                  "--temperatures", "0,1", "--max-tokens", "8", "--n-prompts", "2", "--json", str(out_json), "--plot", str(out_png),
                  "--no-progress", env={"BLOCKSPEC_THREADS": "1"}, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(out_json.read_text())
    assert MACHINE_KEYS <= set(data["machine"])
    assert data["machine"]["threads"] == 1
    runs = {(r["method"], r["temperature"]): r for r in data["runs"]}
    methods = ("plain", "ngram", "specblock", "ngram-upstream-kernels", "specblock-pilot")
    assert set(runs) == {(m, t) for m in methods for t in (0.0, 1.0)}
    for (m, t), r in runs.items():
        assert RUN_KEYS <= set(r), r
        assert "error" not in r
        assert r["n_prompts"] == 2
        assert 0 < r["n_tokens"] <= 16
        assert r["tau"] >= 1.0 and r["tokens_per_s"] > 0
        # every target pass is in the histogram; plain accepts no drafted token by definition
        assert sum(r["accept_hist"]) >= 1
        if m == "plain":
            assert r["tau"] == 1.0 and len(r["accept_hist"]) == 1
            assert r["speedup_vs_plain"] == pytest.approx(1.0)
        if m != "ngram-upstream-kernels":  # not bit-exact by design
            assert r["lossless"] is (True if t == 0 else None)
        assert r["kernels"] == ("upstream" if m == "ngram-upstream-kernels" else "batch-invariant")
        if m == "specblock-pilot":  # the shipped pilot chose one drafted-token count per prompt
            assert len(r["block_sizes"]) == 2 and all(1 <= b <= 4 for b in r["block_sizes"])
            assert all(0 < c < 1 for c in r["pilot_accept"])
        pp = r["per_prompt"]
        assert pp["index"] == [0, 1] and sum(pp["n_tokens"]) == r["n_tokens"] and min(pp["gen_s"]) > 0
        if m != "plain":
            lo, hi = r["speedup_ci95"]
            assert 0 < lo <= hi
    assert runs[("ngram", 0.0)]["lossless"] is True
    assert 0.0 <= runs[("ngram", 0.0)]["draft_fraction"] <= 1.0
    # the shipped SpecBlock drafter: lossless, and a block costs a positive share of a plain token
    assert runs[("specblock", 0.0)]["lossless"] is True
    assert 0.0 < runs[("specblock", 0.0)]["draft_cost"] < 10.0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup" in res.stdout and "ngram" in res.stdout


def test_speed_ratio_interval():
    """The paired bootstrap of one row's speed over another's: exact where every prompt has the same
    ratio, around the ratio of summed speeds otherwise, narrower with more prompts, and None without
    two shared prompts."""
    import numpy as np

    rs = np.random.default_rng(0)

    def row(idx, tok, sec):
        return {"index": list(idx), "n_tokens": list(tok), "gen_s": list(sec)}

    tok, sec = rs.integers(50, 256, 40), rs.uniform(1, 4, 40)
    assert speed_ratio_ci(row(range(40), tok, sec / 1.5), row(range(40), tok, sec)) == [1.5, 1.5]
    widths = []
    for n in (10, 160):
        tok, sec = rs.integers(50, 256, n), rs.uniform(1, 4, n)
        noisy = sec * rs.uniform(0.7, 1.1, n)  # a row ~10% faster, with prompt-to-prompt spread
        lo, hi = speed_ratio_ci(row(range(n), tok, noisy), row(range(n), tok, sec))
        point = (tok.sum() / noisy.sum()) / (tok.sum() / sec.sum())
        assert lo < point < hi
        widths.append(hi - lo)
    assert widths[1] < widths[0] / 2
    # only the shared prompts count
    assert speed_ratio_ci(row([0, 5], [10, 10], [1, 1]), row([5, 7], [10, 10], [2, 2])) is None
    assert speed_ratio_ci(row([0, 1, 2], [10, 10, 10], [1, 1, 9]), row([0, 1], [10, 10], [2, 2])) == [2.0, 2.0]


def test_prompts_jsonl_and_errors(tmp_path):
    msgs = load_prompts(str(_prompts_file(tmp_path)), n_prompts=None)
    assert msgs[0] == [{"role": "user", "content": "Repeat after me three times: the red fox runs, the red fox runs."}]
    assert msgs[1][0]["content"].startswith("List the numbers")
    assert len(load_prompts(str(_prompts_file(tmp_path)), n_prompts=1)) == 1
    both = load_prompts(f"{_prompts_file(tmp_path)},{_prompts_file(tmp_path)}", n_prompts=1)  # each source
    assert both == [msgs[0], msgs[0]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt key"}\n')
    with pytest.raises(BlockspecError, match=r"bad.jsonl:1: .*\"prompt\""):
        load_prompts(str(bad))
    with pytest.raises(BlockspecError, match="no such file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_prompts_mtbench():
    qs = load_prompts("mtbench", n_prompts=None)
    assert len(qs) == 80
    assert all(len(m) == 1 and m[0]["role"] == "user" and m[0]["content"] for m in qs)


def test_prompts_humaneval():
    qs = load_prompts("humaneval", n_prompts=None)
    assert len(qs) == 164
    assert qs[0][0]["content"].lstrip().startswith(("from ", "def ", "import "))


def test_methods_and_drafters_parse():
    assert parse_methods("ngram,plain,ngram,llama.cpp-ngram") == ["plain", "ngram", "llama.cpp-ngram"]
    with pytest.raises(BlockspecError, match="unknown bench method 'eagle'"):
        parse_methods("plain,eagle")
    assert parse_drafters(["specblock=/x", "llama.cpp-draft=qwen2.5-coder-0.5b"]) == {
        "specblock": "/x", "llama.cpp-draft": "qwen2.5-coder-0.5b"}
    with pytest.raises(BlockspecError, match="METHOD=PATH"):
        parse_drafters(["specblock"])
    assert all(m.peer is not None for n, m in METHODS.items() if n.startswith("llama.cpp-"))
    # a tagged row is its method run again with its own drafter; untagged rows keep theirs
    from blockspec.runtime.bench.run import _drafter_for, method

    assert parse_methods("specblock,specblock@new,specblock-pilot@new") == [
        "plain", "specblock", "specblock@new", "specblock-pilot@new"]
    assert method("specblock-pilot@new") is METHODS["specblock-pilot"]
    d = parse_drafters(["specblock@new=/new"])
    assert [_drafter_for(n, d) for n in ("specblock", "specblock@new", "specblock-pilot@new")] == [None, "/new", "/new"]
    # a combined row serves its model drafter's tagged file
    assert [_drafter_for(n, d) for n in ("specblock+ngram", "specblock+ngram@new")] == [None, "/new"]
    with pytest.raises(BlockspecError, match="unknown bench method 'eagle@x'"):
        parse_methods("eagle@x")


def test_bench_unknown_method_is_one_line():
    res = run_cli("bench", "--prompts", "mtbench", "--methods", "plain,eagle", timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "unknown bench method 'eagle'" in res.stderr


@pytest.mark.heavy
def test_bench_upstream_peers(tmp_path):
    """Upstream's llama-speculative-simple (ggml_patches/build_tools.py) runs on the same prompts:
    its greedy output equals our plain output (short prompts: below 64 rows the prefill kernels are
    batch invariant, see bench.py), and its n-gram drafting accepts tokens on a repetitive prompt."""
    from blockspec.runtime.bench.run import run_bench
    from blockspec.runtime.bench.peers import find_tool

    try:
        find_tool()
    except BlockspecError as e:
        pytest.skip(str(e))
    prompts = _prompts_file(tmp_path)
    res = run_bench(str(prompts), methods="plain,ngram,llama.cpp-plain,llama.cpp-ngram", temperatures="0,1",
                    max_tokens=48, n_prompts=2, threads=1, progress=False, json_path=str(tmp_path / "b.json"))
    runs = {(r["method"], r["temperature"]): r for r in res["runs"]}
    for m in ("llama.cpp-plain", "llama.cpp-ngram"):
        for t in (0.0, 1.0):
            r = runs[(m, t)]
            assert "error" not in r, r
            assert r["n_prompts"] == 2 and r["n_tokens"] >= 2 and r["tokens_per_s"] > 0
            assert sum(r["accept_hist"]) >= 1
        assert runs[(m, 0.0)]["lossless"] is True
    assert runs[("llama.cpp-plain", 0.0)]["tau"] == pytest.approx(1.0)
    assert runs[("llama.cpp-ngram", 0.0)]["tau"] > 1.0
    assert sum(runs[("llama.cpp-ngram", 0.0)]["accept_hist"][1:]) > 0
    # upstream's other model-free drafters, and llama-lookup with a static cache of the shipped answer store
    from blockspec.runtime.engine.setup import shipped_drafter

    others = ["llama.cpp-ngram-map-k", "llama.cpp-ngram-mod", "llama.cpp-ngram-cache"]
    store = shipped_drafter("ngram")
    if store:
        others.append("llama.cpp-lookup-store")
    res = run_bench(str(prompts), methods=",".join(["plain", *others]), temperatures="0", max_tokens=48,
                    n_prompts=2, threads=1, progress=False)
    for r in res["runs"]:
        assert "error" not in r, r
        assert r["n_prompts"] == 2 and r["tokens_per_s"] > 0 and r["tau"] >= 1.0
    # a peer that cannot run reports an error entry and the bench goes on
    res = run_bench(str(prompts), methods="plain,llama.cpp-draft", temperatures="0", max_tokens=8, n_prompts=1,
                    threads=1, progress=False, drafter=["llama.cpp-draft=" + str(prompts)])
    bad = next(r for r in res["runs"] if r["method"] == "llama.cpp-draft")
    assert bad["error"] and bad["n_prompts"] == 0
