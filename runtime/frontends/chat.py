"""`blockspec chat`: an interactive chat over `SpeculativeLlama`, streaming each answer.

The history is rendered with the GGUF chat template every turn; the runtime reuses the
cached prefix, so only the new turn is prefilled. Ctrl-C during an answer stops it and
keeps the session: the partial answer stays in the history (it was shown, so the model
should see it too). Ctrl-C at the prompt clears the line; Ctrl-D or /exit quits.
"""

from __future__ import annotations

import json
import signal
import sys
from contextlib import closing
from dataclasses import dataclass, field
from typing import Callable, TextIO

from blockspec.runtime.errors import BlockspecError

HELP = "commands: /reset (clear history), /stats (last answer's stats), /temp X (temperature), /exit"


@dataclass
class ChatSession:
    """A conversation: messages so far plus the sampling settings of the next answer."""

    llm: object  # a SpeculativeLlama
    system: str | None = None
    temperature: float = 0.2
    max_tokens: int | None = 1024
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, question: str, on_text: Callable[[str], None],
               stop_requested: Callable[[], bool] = lambda: False) -> str:
        """Stream an answer to `question`; return its finish reason ("stop", "length",
        "interrupted"). The question and the (possibly partial) answer join the history;
        a question the model cannot take (context full) is dropped and raises."""
        self.messages.append({"role": "user", "content": question})
        parts: list[str] = []
        reason = "interrupted"
        try:
            self.llm.check_prompt(messages=self.messages)
            stream = self.llm.create_chat_completion(self.messages, temperature=self.temperature,
                                                     max_tokens=self.max_tokens, stream=True)
            with closing(stream):
                for chunk in stream:
                    choice = chunk["choices"][0]
                    text = choice["delta"].get("content")
                    if text:
                        parts.append(text)
                        on_text(text)
                    if choice["finish_reason"] is not None:
                        reason = choice["finish_reason"]
                    if stop_requested() and choice["finish_reason"] is None:
                        reason = "interrupted"
                        break
        except BlockspecError:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(parts)})
        return reason


class _SigintFlag:
    """While active, Ctrl-C sets a flag instead of raising, so an answer stops between
    target passes and never inside native code or a cache rewind."""

    def __init__(self):
        self.set = False
        self._old = None

    def __enter__(self):
        self.set = False
        self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        self.set = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


def run_chat(*, model: str | None = None, drafter: str | None = None, method: str | None = None,
             drafter_backend: str | None = None, block_size: int | str | None = None, blockpilot: str | None = None,
             temperature: float = 0.2,
             acceptance: str = "rejection",
             system: str | None = None, max_tokens: int | None = 1024, n_ctx: int = 4096, seed: int | None = None,
             verbose: bool = False, stdin: TextIO | None = None, out: TextIO | None = None,
             err: TextIO | None = None, adapt: bool = False) -> None:
    from blockspec.runtime.frontends.llama_api import SpeculativeLlama

    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    llm = SpeculativeLlama(model, drafter_path=drafter, method=method, drafter_backend=drafter_backend,
                           block_size=block_size, blockpilot=blockpilot, n_ctx=n_ctx, seed=seed, verbose=verbose, acceptance=acceptance,
                           adapt=adapt)
    with llm:
        session = ChatSession(llm, system=system, temperature=temperature, max_tokens=max_tokens)
        err.write(f"blockspec chat: {llm.target.path.name}, method {llm.method}. {HELP}\n")
        err.flush()
        _repl(session, stdin, out, err)


def adapt_note(adapt: dict | None) -> str:
    """", adapt: full update 0.84 s, +0.12 tok/block, kept (session: 0 head, 1 full kept, 0.84 s)" for
    Stats.adapt; "" without."""
    if not adapt:
        return ""
    u = adapt["updates"]
    did = "skip" if adapt["action"] == "skip" else (
        f"{adapt['action']} update {adapt['update_s']:.2f} s, {adapt['effect']:+.2f} tok/block, "
        + ("kept" if adapt["kept"] else "undone"))
    return (f"; adapt: {did} (session: {u['head']} head, {u['full']} full kept, "
            f"{adapt['update_s_total']:.2f} s)")


def _read(stdin: TextIO, out: TextIO) -> str | None:
    if stdin is sys.stdin and stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        return input("> ")
    out.write("> ")
    out.flush()
    line = stdin.readline()
    if not line:
        raise EOFError
    return line.rstrip("\n")


def _repl(session: ChatSession, stdin: TextIO, out: TextIO, err: TextIO) -> None:
    while True:
        try:
            line = _read(stdin, out)
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n(Ctrl-D or /exit to quit)\n")
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if _command(session, line, out, err):
                return
            continue

        def show(text):
            out.write(text)
            out.flush()

        try:
            with _SigintFlag() as flag:
                reason = session.answer(line, show, lambda: flag.set)
        except BlockspecError as e:
            err.write(f"\nblockspec: error: {e} (try /reset)\n")
            continue
        out.write("\n")
        s = session.llm.last_stats or {}
        note = " (interrupted)" if reason == "interrupted" else " (max tokens)" if reason == "length" else ""
        err.write(f"[{s.get('method')}] tau {s.get('tau', 0):.2f}, {s.get('tokens_per_s', 0):.1f} tok/s{note}"
                  f"{adapt_note(s.get('adapt'))}\n")
        err.flush()


def _command(session: ChatSession, line: str, out: TextIO, err: TextIO) -> bool:
    """Run a /command; True means quit."""
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return True
    if name == "/reset":
        session.reset()
        err.write("history cleared\n")
    elif name == "/stats":
        err.write(json.dumps(session.llm.last_stats, indent=1) + "\n" if session.llm.last_stats
                  else "no answer yet\n")
    elif name == "/temp":
        try:
            t = float(arg)
            if t < 0:
                raise ValueError
        except ValueError:
            err.write(f"/temp needs a number >= 0 (now {session.temperature})\n")
        else:
            session.temperature = t
            err.write(f"temperature {t}\n")
    else:
        err.write(HELP + "\n")
    err.flush()
    return False
