"""The generation loop and its stats (the JSON contract of `blockspec generate --json`).

A method is a step function: given the state after prefill it yields, per target
pass, the list of tokens that pass emitted. `plain_steps` emits one token a pass;
`speculative.speculative_steps` emits the accepted draft tokens plus one more. The loop
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
from blockspec.runtime.drafters.base import common_prefix
from blockspec.runtime.engine.sampling import SamplingParams, make_rng, sample, sample_row


@dataclass
class Stats:
    method: str
    drafter_backend: str | None = None
    acceptance: str | None = None  # greedy | match | rejection (speculative.acceptance_rule); None: plain
    tau: float = 0.0  # new tokens per target pass (prefill included, so plain is exactly 1.0)
    target_passes: int = 0
    tokens_per_s: float = 0.0  # generated tokens / generation wall time (prefill excluded)
    draft_s: float = 0.0  # the drafter: its proposals and its pass over the committed rows
    verify_s: float = 0.0
    draft_fraction: float = 0.0  # draft_s / (draft_s + verify_s)
    accept_hist: list[int] = field(default_factory=list)  # [k] = passes that accepted k drafted tokens
    drafted: int = 0  # drafted tokens verified over the generation (the verify rows beyond one per pass)
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    block_size: int | None = None  # drafted tokens per block BlockPilot chose for this request (else None)
    pilot_accept: float | None = None  # BlockPilot's predicted per-token acceptance (None: no pilot)
    # --adapt (runtime/engine/adapt.py), after the request: action (skip|head|full), update_s, effect
    # (accepted tokens per block won on the held-back request), kept, signal (mean per block), blocks,
    # signal_s, and the session's updates kept {head, full}, undone {head, full} and update_s_total
    adapt: dict | None = None

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
    tokens: list[int]  # prompt + emitted; the cache holds all but the last
    logits: np.ndarray  # target logits after the last token in the cache
    sampling: SamplingParams
    rng: np.random.Generator
    stats: Stats
    drafter: object = None


StepFn = Callable[[StepState], Iterator[list[int]]]


def plain_steps(s: StepState) -> Iterator[list[int]]:
    """One target pass per token: sample from the current logits, decode it, repeat (the pass's
    row is sampled where llama.cpp holds it: sampling.sample_row)."""
    t = s.target
    tok = sample(s.logits, s.sampling, s.rng, s.tokens)  # the prefill pass's token
    while True:
        s.stats.record_pass(0)
        yield [tok]
        t0 = time.perf_counter()
        t.decode([tok], [len(s.tokens) - 1])  # the caller appended tok to s.tokens
        s.stats.verify_s += time.perf_counter() - t0
        tok = sample_row(t, -1, s.sampling, s.rng, s.tokens)


def _prefill(target, prompt: list[int], drafter) -> np.ndarray:
    """Decode the prompt, reusing the longest cached prefix (the last prompt token is always
    decoded, for its logits); the drafter is trimmed and fed the same rows."""
    common = min(common_prefix(target.cached, prompt), len(prompt) - 1)
    if drafter is not None:
        common = min(common, drafter.held_prefix(prompt))
    target.remove(-1, common, -1)
    target.cached = prompt[:common]
    layers = tuple(drafter.target_layers) if drafter is not None else ()
    if layers:
        target.enable_taps(layers)
    if drafter is not None:
        drafter.trim(common)
    pos = [common]

    def feed(chunk):
        if drafter is not None:
            drafter.observe(chunk, pos[0], {lid: target.tap(lid) for lid in layers} or None)
        pos[0] += len(chunk)

    logits = target.prefill(prompt[common:], start=common, on_chunk=feed)
    target.cached = list(prompt)
    return logits


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
                    sampling: SamplingParams = SamplingParams(), drafter=None,
                    stats: Stats | None = None) -> Iterator[tuple[list[int], str]]:
    """Yield (new tokens, new text) per target pass; `stats` (pass one in) is filled as it goes.

    Without a drafter this is plain decoding; with one, speculative decoding. The cached
    prefix shared with the previous call is reused. On exit (normal, error, or
    GeneratorExit from an interrupted consumer) the cache holds exactly prompt + emitted
    tokens except the last, and `target.cached` says so.
    """
    from blockspec.runtime.engine.speculative import acceptance_rule, speculative_steps

    prompt = list(prompt)
    if not prompt:
        raise BlockspecError("empty prompt")
    if len(prompt) >= target.n_ctx:
        raise BlockspecError(f"prompt is {len(prompt)} tokens but the context holds {target.n_ctx} "
                             "(raise --n-ctx or shorten the prompt)")
    if drafter is not None:
        drafter.check_target(target)
        target.exact_batch_limit  # probe (clears the cache) before the prefill, once per model
    stats = stats if stats is not None else Stats(method="plain")
    stats.method = drafter.name if drafter is not None else "plain"
    stats.drafter_backend = drafter.backend if drafter is not None else None
    stats.acceptance = acceptance_rule(sampling, drafter) if drafter is not None else None
    stats.prompt_tokens = len(prompt)
    t0 = time.perf_counter()
    try:
        logits = _prefill(target, prompt, drafter)
    except BaseException:
        target.clear()  # an interrupted prefill leaves an unknown cache: start afresh next time
        raise
    pilot = getattr(drafter, "pilot", None)
    if pilot is not None:  # runtime/engine/pilot.py: this request's block size from the prefill's logits
        pilot.apply(drafter, logits, stats)  # (its time counts as prefill)
    stats.prefill_s = time.perf_counter() - t0
    state = StepState(target, prompt, logits, sampling, make_rng(sampling.seed), stats, drafter)
    steps = plain_steps if drafter is None else speculative_steps
    budget = min(max_tokens, target.n_ctx - len(prompt))
    text = Utf8Text(target)
    n_out = 0
    n_eog = 0
    adapter = getattr(drafter, "adapter", None)  # runtime/engine/adapt.py: --adapt
    if adapter is not None:
        adapter.begin_request()
    ended = False  # the request ran to its end, or its consumer closed it (not an error)
    t_gen = time.perf_counter()
    try:
        for new in steps(state):
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
        ended = True
    except GeneratorExit:
        ended = True
        raise
    finally:
        stats.finish(n_out, n_out + n_eog, time.perf_counter() - t_gen)
        # drop rows past the last emitted token (rejected by a stop or the token budget)
        keep = len(state.tokens) - 1
        target.remove(-1, keep, -1)
        target.cached = state.tokens[:keep]
        if drafter is not None:
            drafter.trim(keep)
        if adapter is not None and ended:  # between requests, off every step: may update the drafter
            adapter.after_request(state.tokens, stats.prompt_tokens, stats)


def generate(target, prompt: Sequence[int], *, max_tokens: int = 256, sampling: SamplingParams = SamplingParams(),
             drafter=None, on_text: Callable[[str], None] | None = None) -> Generation:
    """Run `generate_stream` to the end; Ctrl-C returns what was generated so far."""
    stats = Stats(method="plain")
    tokens: list[int] = []
    parts: list[str] = []
    reason = "length"
    stream = generate_stream(target, prompt, max_tokens=max_tokens, sampling=sampling, drafter=drafter, stats=stats)
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
