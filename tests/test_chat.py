"""`blockspec chat`: the REPL through a real pty (Ctrl-C mid-answer keeps the session), and its
commands against a stand-in model."""

from __future__ import annotations

import io
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from blockspec.runtime.frontends.chat import ChatSession, _repl


class _Pty:
    def __init__(self, args, env):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.seen = b""

    def expect(self, pattern: bytes, timeout: float = 60.0) -> bytes:
        """Read until `pattern` (a regex) matches the output after the last expect; return that output."""
        start = len(self.seen)
        deadline = time.time() + timeout
        while not re.search(pattern, self.seen[start:]):
            left = deadline - time.time()
            if left <= 0 or self.proc.poll() is not None and not select.select([self.master], [], [], 0)[0]:
                raise AssertionError(f"no {pattern!r} in {self.seen[start:]!r}")
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:
                    pass
        return self.seen[start:]

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def test_chat_repl_ctrl_c_keeps_session(smollm2_path):
    args = [sys.executable, "-c", "from blockspec.runtime.frontends.cli_apps import chat; chat()",
            "--model", str(smollm2_path), "--method", "ngram", "--temperature", "0", "--max-tokens", "400",
            "--n-ctx", "2048"]
    t = _Pty(args, {**os.environ, "BLOCKSPEC_THREADS": "1", "TERM": "dumb"})
    try:
        t.expect(rb"> ")
        t.send("Write a very long story about a dragon who learns to paint.\n")
        t.expect(rb"paint\.\r?\n.{20,}", timeout=60)  # the answer is streaming
        t.proc.send_signal(signal.SIGINT)
        out = t.expect(rb"> ", timeout=60)
        assert b"(interrupted)" in out and b"tau " in out and b"tok/s" in out

        t.send("What is the capital of France?\n")
        out = t.expect(rb"tok/s.*\n.*> ", timeout=90)
        assert b"(interrupted)" not in out
        assert b"tau " in out

        t.send("/stats\n")
        assert b'"tau"' in t.expect(rb"> ")
        t.send("/exit\n")
        assert t.proc.wait(timeout=30) == 0
    finally:
        t.close()


class _FakeLlm:
    """Answers every question with a fixed streamed reply."""

    def __init__(self):
        self.last_stats = None
        self.seen = []

    def check_prompt(self, messages):
        return 1

    def create_chat_completion(self, messages, temperature, max_tokens, stream):
        self.seen.append((list(messages), temperature))
        self.last_stats = {"method": "fake", "tau": 2.0, "tokens_per_s": 10.0}

        def chunks():
            yield {"choices": [{"delta": {"role": "assistant"}, "finish_reason": None}]}
            for word in ("Hello", " there"):
                yield {"choices": [{"delta": {"content": word}, "finish_reason": None}]}
            yield {"choices": [{"delta": {}, "finish_reason": "stop"}]}

        return chunks()


def test_repl_commands_and_eof():
    llm = _FakeLlm()
    session = ChatSession(llm, system="be brief", temperature=0.2)
    out, err = io.StringIO(), io.StringIO()
    _repl(session, io.StringIO("hi\n/temp 0.7\n/temp x\nagain\n/stats\n/reset\n/bogus\n"), out, err)  # then EOF
    assert "Hello there" in out.getvalue()
    assert "tau 2.00" in err.getvalue() and "temperature 0.7" in err.getvalue()
    assert "/temp needs a number" in err.getvalue() and "commands:" in err.getvalue()
    assert '"tau": 2.0' in err.getvalue() and "history cleared" in err.getvalue()
    history, temp = llm.seen[1]
    assert temp == 0.7
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user"]
    assert session.messages == [{"role": "system", "content": "be brief"}]
