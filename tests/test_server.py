"""`blockspec serve`'s app over real HTTP on loopback, driven by the openai client and httpx."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_path):
    from blockspec.runtime.frontends.llama_api import SpeculativeLlama
    from blockspec.runtime.frontends.server import make_app

    with SpeculativeLlama(str(smollm2_path), method="ngram", n_ctx=1024, n_threads=1) as llm:
        port = _free_port()
        srv = uvicorn.Server(uvicorn.Config(make_app(llm, "smollm2"), host="127.0.0.1", port=port,
                                            log_level="warning"))
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        deadline = time.time() + 30
        while not srv.started:
            assert time.time() < deadline and th.is_alive(), "server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", llm
        srv.should_exit = True
        th.join(timeout=10)


def test_openai_client_chat_and_stream(server):
    openai = pytest.importorskip("openai")
    url, llm = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list()] == ["smollm2"]
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens <= 12
    direct = llm.create_chat_completion(msgs, max_tokens=12, temperature=0)
    assert text == direct["choices"][0]["message"]["content"]

    stream = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=12, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    done = client.completions.create(model="smollm2", prompt="One, two, three,", max_tokens=8, temperature=0)
    assert done.choices[0].text == llm("One, two, three,", max_tokens=8, temperature=0)["choices"][0]["text"]


def test_completion_sse_over_httpx(server):
    url, llm = server
    want = llm("Once upon a time", max_tokens=10, temperature=0)["choices"][0]["text"]
    events = []
    with httpx.stream("POST", url + "/v1/completions", timeout=120,
                      json={"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    import json

    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "hi", "frobnicate": 1}', "unknown field 'frobnicate'"),
    (b'{"prompt": "hi", "temperature": -1}', "temperature"),
    (b'{"max_tokens": 4}', "prompt"),
])
def test_bad_requests_get_400(server, body, needle):
    url, _ = server
    r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]


def test_prompt_too_long_gets_400(server):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "word " * 2000}], "stream": True})
    assert r.status_code == 400
    assert "context" in r.json()["error"]["message"]
