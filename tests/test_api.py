"""SpeculativeLlama: llama-cpp-python's shapes, greedy parity with llama_cpp.Llama, streaming, stop strings."""

from __future__ import annotations

import threading

import pytest

from blockspec.runtime.frontends.llama_api import SpeculativeLlama, StopText

PROMPT = "The three most important inventions of the twentieth century are"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    with SpeculativeLlama(str(smollm2_path), method="ngram", n_ctx=1024, seed=0, n_threads=1) as m:
        yield m


def test_greedy_completion_matches_llama_cpp(llm, smollm2_path):
    import llama_cpp

    ref = llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=1024, verbose=False, flash_attn=True, n_threads=1)
    try:
        want = ref.create_completion(PROMPT, max_tokens=32, temperature=0.0)
        want_tokens = ref.tokenize(PROMPT.encode(), special=True)
    finally:
        ref.close()
    got = llm.create_completion(PROMPT, max_tokens=32, temperature=0.0)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"]
    assert llm.tokenize(PROMPT.encode(), special=True) == want_tokens
    assert got["object"] == "text_completion" and got["id"].startswith("cmpl-")
    assert set(got) == set(want)
    assert set(got["choices"][0]) == set(want["choices"][0])
    assert got["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"] == "length"
    assert llm.last_stats["method"] == "ngram" and llm.last_stats["target_passes"] > 0


def test_stream_concatenates_to_completion(llm):
    whole = llm(PROMPT, max_tokens=24, temperature=0)
    chunks = list(llm.create_completion(PROMPT, max_tokens=24, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_completion_and_stream(llm):
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = llm.create_chat_completion(msgs, max_tokens=12, temperature=0)
    assert whole["object"] == "chat.completion"
    msg = whole["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"]
    chunks = list(llm.create_chat_completion(msgs, max_tokens=12, temperature=0, stream=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == msg["content"]


def test_stop_string_across_chunks(llm):
    full = llm(PROMPT, max_tokens=32, temperature=0)["choices"][0]["text"]
    # a stop string spanning two or more tokens, starting a few tokens in
    stop = full[9:17]
    assert len(llm.tokenize(stop.encode(), add_bos=False)) >= 2
    for stream in (False, True):
        if stream:
            chunks = list(llm(PROMPT, max_tokens=32, temperature=0, stop=[stop], stream=True))
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            out = llm(PROMPT, max_tokens=32, temperature=0, stop=stop)
            text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            assert out["usage"]["completion_tokens"] < 32
        assert text == full[:full.find(stop)]
        assert reason == "stop"


def test_stop_string_with_multibyte_character(llm):
    # SmolLM2 spells the dragon emoji (4 UTF-8 bytes) with three tokens
    prompt = "\U0001f409 dragon, \U0001f409 dragon, \U0001f409 dragon, \U0001f409 dragon,"
    full = llm(prompt, max_tokens=12, temperature=0)["choices"][0]["text"]
    stop = ", \U0001f409 drag"
    assert full.startswith(" \U0001f409 dragon" + stop), full
    chunks = list(llm(prompt, max_tokens=12, temperature=0, stop=["zzz", stop], stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == " \U0001f409 dragon"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    out = llm(prompt, max_tokens=12, temperature=0, stop=stop)
    assert out["choices"][0]["text"] == " \U0001f409 dragon"
    # the completion ends with the token that completes the stop string (" dragon")
    assert out["usage"]["completion_tokens"] == 9


def test_stop_text_holds_back_partial_matches():
    s = StopText(["<end>", "xé!"])
    assert s.push("abc<e") == "abc"
    assert s.push("n") == ""
    assert s.push("x") == "<en"  # "x" may start "xé!"
    assert s.push("é") == ""
    assert s.push("!tail") == ""
    assert s.hit == "xé!"
    assert s.flush() == ""
    s = StopText(["<end>"])
    assert s.push("a<") == "a"
    assert s.flush() == "<"


def test_calls_serialize_across_threads(llm):
    results = {}

    def run(i):
        results[i] = llm(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results.values())) == 1

    gen = llm(PROMPT, max_tokens=8, temperature=0, stream=True)
    next(gen)
    with pytest.raises(RuntimeError, match="still open"):
        llm(PROMPT, max_tokens=2)
    gen.close()
    assert llm(PROMPT, max_tokens=8, temperature=0)["choices"][0]["text"] == results[0]
