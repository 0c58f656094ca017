"""The generation loop and its stats (the JSON contract of `blockspec generate --json`).

A method is a step function: given the state after prefill it yields, per target
pass, the list of tokens that pass committed. `plain` commits one token a pass; the
speculative methods (later) commit an accepted block plus a bonus token. The loop
around it is shared: stopping on end-of-generation, max tokens and the context
limit, UTF-8 safe text, timing, and the accept histogram.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.sampling import SamplingParams, make_rng, sample


@dataclass
class Stats:
    method: str
    drafter_backend: str | None = None
    tau: float = 0.0  # new tokens per target pass (prefill included, so plain is exactly 1.0)
    target_passes: int = 0
    tokens_per_s: float = 0.0  # generated tokens / generation wall time (prefill excluded)
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_fraction: float = 0.0  # draft_s / (draft_s + verify_s)
    accept_hist: list[int] = field(default_factory=list)  # [k] = passes that accepted k drafted tokens
    prefill_s: float = 0.0
    prompt_tokens: int = 0

    def record_pass(self, n_accepted: int) -> None:
        if len(self.accept_hist) <= n_accepted:
            self.accept_hist.extend([0] * (n_accepted + 1 - len(self.accept_hist)))
        self.accept_hist[n_accepted] += 1
        self.target_passes += 1

    def finish(self, n_tokens: int, n_produced: int, gen_s: float) -> None:
        # tau counts a final end-of-generation token too: the pass that produced it was real work
        self.tau = n_produced / self.target_passes if self.target_passes else 0.0
        self.tokens_per_s = n_tokens / gen_s if gen_s > 0 else 0.0
        busy = self.draft_s + self.verify_s
        self.draft_fraction = self.draft_s / busy if busy > 0 else 0.0


@dataclass
class Generation:
    text: str
    tokens: list[int]
    stats: Stats
    finish_reason: str  # "stop" (end of generation), "length" (max tokens or context), "interrupted"

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def to_json(self) -> dict:
        return {"text": self.text, "tokens": self.tokens, "n_tokens": self.n_tokens,
                "finish_reason": self.finish_reason, "stats": asdict(self.stats)}


@dataclass
class StepState:
    """What a method's step function sees: the target, the tokens so far, sampling."""

    target: object
    tokens: list[int]  # prompt + generated, all committed to the target cache except the last
    logits: np.ndarray  # target logits after the last committed token
    sampling: SamplingParams
    rng: np.random.Generator
    stats: Stats


StepFn = Callable[[StepState], Iterator[list[int]]]


def plain_steps(s: StepState) -> Iterator[list[int]]:
    """One target pass per token: sample from the current logits, decode it, repeat."""
    t = s.target
    while True:
        tok = sample(s.logits, s.sampling, s.rng, s.tokens)
        s.stats.record_pass(0)
        yield [tok]
        t0 = time.perf_counter()
        t.decode([tok], [len(s.tokens) - 1])  # the caller appended tok to s.tokens
        s.logits = t.logits_row(-1)
        s.stats.verify_s += time.perf_counter() - t0


METHODS: dict[str, StepFn] = {"plain": plain_steps}


class Utf8Text:
    """Token bytes -> text that never splits a multi-byte character across chunks."""

    def __init__(self, target):
        self._target = target
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, tokens: Sequence[int]) -> str:
        return self._dec.decode(b"".join(self._target.token_bytes(t) for t in tokens))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


def generate_stream(target, prompt: Sequence[int], *, max_tokens: int = 256,
                    sampling: SamplingParams = SamplingParams(), method: str = "plain",
                    stats: Stats | None = None) -> Iterator[tuple[list[int], str]]:
    """Yield (new tokens, new text) per target pass; `stats` (pass one in) is filled as it goes.

    The target cache is cleared first; on exit (normal, error or GeneratorExit from an
    interrupted consumer) the cache holds exactly prompt + emitted tokens except the last.
    """
    if method not in METHODS:
        raise BlockspecError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    prompt = list(prompt)
    if not prompt:
        raise BlockspecError("empty prompt")
    if len(prompt) >= target.n_ctx:
        raise BlockspecError(f"prompt is {len(prompt)} tokens but the context holds {target.n_ctx} "
                             "(raise --n-ctx or shorten the prompt)")
    stats = stats if stats is not None else Stats(method=method)
    stats.prompt_tokens = len(prompt)
    target.clear()
    t0 = time.perf_counter()
    logits = target.prefill(prompt)
    stats.prefill_s = time.perf_counter() - t0
    state = StepState(target, prompt, logits, sampling, make_rng(sampling.seed), stats)
    budget = min(max_tokens, target.n_ctx - len(prompt))
    text = Utf8Text(target)
    n_out = 0
    n_eog = 0
    t_gen = time.perf_counter()
    try:
        for new in METHODS[method](state):
            done = False
            for i, tok in enumerate(new):
                if target.is_eog(tok):
                    new, done, n_eog = new[:i], True, 1
                    break
            new = new[:budget - n_out]
            state.tokens.extend(new)
            n_out += len(new)
            chunk = text.push(new)
            if n_out >= budget:
                done = True
            if done:
                chunk += text.flush()
            if new or chunk:
                yield new, chunk
            if done:
                break
    finally:
        stats.finish(n_out, n_out + n_eog, time.perf_counter() - t_gen)


def generate(target, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
             method: str = "plain", on_text: Callable[[str], None] | None = None) -> Generation:
    """Run `generate_stream` to the end; Ctrl-C returns what was generated so far."""
    stats = Stats(method=method)
    tokens: list[int] = []
    parts: list[str] = []
    reason = "length"
    stream = generate_stream(target, prompt, max_tokens=max_tokens, sampling=sampling, method=method, stats=stats)
    try:
        for new, chunk in stream:
            tokens.extend(new)
            parts.append(chunk)
            if on_text is not None and chunk:
                on_text(chunk)
        if len(tokens) < max_tokens and len(prompt) + len(tokens) < target.n_ctx:
            reason = "stop"
    except KeyboardInterrupt:
        reason = "interrupted"
    finally:
        stream.close()
    return Generation("".join(parts), tokens, stats, reason)
