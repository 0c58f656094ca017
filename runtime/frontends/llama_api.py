"""`SpeculativeLlama`: llama-cpp-python's `Llama` API over the blockspec runtime.

`create_completion`, `create_chat_completion` and `__call__` take the argument names of
`llama_cpp.Llama` where they overlap and return the same OpenAI-style dicts (or, with
`stream=True`, iterators of the same chunk dicts). Decoding is speculative and lossless:
greedy output equals the target's plain greedy output token for token.

Thread safety: one instance owns one llama.cpp context, so calls serialize on a lock.
A non-streaming call holds it for the call. A streaming call takes it at the first
`next()` and holds it until the iterator is exhausted, closed (`.close()`, or leaving a
`with contextlib.closing(...)` block) or garbage-collected; other threads wait meanwhile.
Starting a second call in the thread that still holds an open stream raises
RuntimeError instead of deadlocking.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict
from typing import Iterator, Sequence

import numpy as np

from blockspec.runtime.engine.adapt import attach_adapter, check_adapt_method
from blockspec.runtime.engine.setup import default_method, open_speculative
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.engine.generate import Stats, generate_stream
from blockspec.runtime.llama.prompt import chat_tokens
from blockspec.runtime.engine.sampling import SamplingParams


class StopText:
    """Incremental stop-string filter over text chunks.

    `push` returns the text that is safe to emit: it holds back a tail that could be the
    start of a stop string, and once a stop string is complete it returns the text before
    it and sets `hit` (the stop string itself is never returned). Chunks are whole
    characters (generate_stream decodes UTF-8 incrementally), so multi-byte characters in
    stop strings match like any other.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hit: str | None = None
        self._buf = ""

    def push(self, text: str) -> str:
        if self.hit is not None:
            return ""
        buf = self._buf + text
        found = [(buf.find(s), s) for s in self.stops if s in buf]
        if found:
            at, stop = min(found)
            self.hit, self._buf = stop, ""
            return buf[:at]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self._buf = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out if self.hit is None else ""


class _Outcome:
    finish_reason: str = "length"
    completion_tokens: int = 0


class SpeculativeLlama:
    """A GGUF target plus a drafter, with the call shapes of `llama_cpp.Llama`.

    model_path: GGUF path or fetched model name (None: the bundled SmolLM2-135M).
    method: drafter method (None: the drafter's own method with the n-gram lookup in front, the lookup
    alone without a drafter; engine.setup.default_method); "plain" decodes without a drafter.
    seed: default sampling seed; calls without their own seed draw from a generator
    seeded with it, so a sequence of calls is reproducible (None: random).
    block_size: drafted tokens per block, "auto" (per step, measured costs) or "pilot" (per request,
    BlockPilot from the prefill's last-token logits; `blockpilot` names its GGUF, default: the one
    next to the drafter).
    adapt: SpecBlock's cost-aware online adaptation (runtime/engine/adapt.py): after each call a
    bandit may update the drafter (never the target), so output stays what it would be without.

    See the module docstring for thread safety.
    """

    def __init__(self, model_path: str | None = None, drafter_path: str | None = None, method: str | None = None,
                 n_ctx: int = 4096, n_gpu_layers: int = -1, seed: int | None = None, verbose: bool = False,
                 n_threads: int | None = None, block_size: int | str | None = None, branches: int = 1,
                 drafter_backend: str | None = None, n_batch: int = 512, acceptance: str = "rejection",
                 blockpilot: str | None = None, adapt: bool = False):
        self.acceptance = SamplingParams(acceptance=acceptance).acceptance  # checked before the model loads
        self.method = method or default_method(model_path, drafter_path, adapt)
        if adapt:
            check_adapt_method(self.method)
        self.target, self.drafter = open_speculative(
            model_path, self.method, drafter_path, drafter_backend, block_size=block_size, branches=branches,
            blockpilot=blockpilot, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads, n_gpu_layers=n_gpu_layers, verbose=verbose)
        self.adapter = None
        if adapt:
            try:
                self.adapter = attach_adapter(self.drafter, self.target)
            except BaseException:
                self.target.close()
                raise
        self.model_path = str(self.target.path)
        self.n_ctx = self.target.n_ctx
        self.verbose = verbose
        self.last_stats: dict | None = None
        self._seeds = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._owner: int | None = None

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Free the model and context (waits for a running call; idempotent)."""
        if self.target.ctx is None:
            return
        with self._guard():
            self.target.close()

    def _check_open(self) -> None:
        if self.target.ctx is None:
            raise RuntimeError("this SpeculativeLlama is closed")

    def __enter__(self) -> "SpeculativeLlama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- tokens
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        self._check_open()
        return self.target.tokenize(text.decode("utf-8", "replace"), add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        self._check_open()
        return b"".join(self.target.token_bytes(t, special=special) for t in tokens)

    def token_eos(self) -> int:
        return self.target.eos

    def token_bos(self) -> int:
        return self.target.bos

    # ---------------------------------------------------------------- locking
    def _guard(self):
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("a streaming completion is still open in this thread; exhaust or close it first")
        llama = self

        class _Held:
            def __enter__(self):
                llama._lock.acquire()
                llama._owner = me
                if llama.target.ctx is None:
                    self.__exit__()
                    raise RuntimeError("this SpeculativeLlama is closed")

            def __exit__(self, *exc):
                llama._owner = None
                llama._lock.release()

        return _Held()

    # ---------------------------------------------------------------- core loop
    def _sampling(self, temperature, top_k, top_p, min_p, repeat_penalty, seed) -> SamplingParams:
        if seed is None:
            seed = int(self._seeds.integers(0, 2**63 - 1))
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, seed=seed, acceptance=self.acceptance)

    def _texts(self, prompt: list[int], max_tokens: int | None, sampling: SamplingParams,
               stop: str | list[str] | None, out: _Outcome) -> Iterator[str]:
        """Text pieces of one generation (never empty, never containing a stop string);
        `out` holds the finish reason and completion token count when it ends."""
        room = self.target.n_ctx - len(prompt)
        budget = room if max_tokens is None or max_tokens <= 0 else min(max_tokens, room)
        stops = StopText([stop] if isinstance(stop, str) else list(stop or []))
        stats = Stats(method=self.method)
        tokens: list[int] = []
        emitted: list[str] = []
        try:
            stream = generate_stream(self.target, prompt, max_tokens=budget, sampling=sampling,
                                     drafter=self.drafter, stats=stats)
            try:
                for new, chunk in stream:
                    tokens.extend(new)
                    piece = stops.push(chunk)
                    if piece:
                        emitted.append(piece)
                        yield piece
                    if stops.hit is not None:
                        break
            finally:
                stream.close()
            if stops.hit is None:
                piece = stops.flush()
                if piece:
                    emitted.append(piece)
                    yield piece
                out.finish_reason = "length" if len(tokens) >= budget else "stop"
                out.completion_tokens = len(tokens)
            else:
                out.finish_reason = "stop"
                out.completion_tokens = self._tokens_covering(tokens, "".join(emitted) + stops.hit)
        finally:
            self.last_stats = asdict(stats)

    def _tokens_covering(self, tokens: list[int], text: str) -> int:
        """How many of `tokens` it takes to produce `text` (a speculative pass can emit
        tokens past a stop string; they are not part of the completion)."""
        need = len(text.encode("utf-8"))
        have = 0
        for i, t in enumerate(tokens):
            have += len(self.target.token_bytes(t))
            if have >= need:
                return i + 1
        return len(tokens)

    def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            # as llama_cpp.Llama: the vocab's BOS, special tokens parsed
            return self.target.tokenize(prompt, add_special=True, parse_special=True) if prompt else [self.target.bos]
        return list(prompt)

    def check_prompt(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None) -> int:
        """Token count of a completion prompt or chat; BlockspecError when it does not fit the
        context (the server checks before it starts a stream). Reads only the vocabulary, so
        it does not wait for a running generation."""
        self._check_open()
        tokens = self._prompt_tokens(prompt) if messages is None else chat_tokens(self.target, messages)
        self._check_fits(tokens)
        return len(tokens)

    def _check_fits(self, tokens: list[int]) -> None:
        if not tokens:
            raise BlockspecError("empty prompt")
        if len(tokens) >= self.target.n_ctx:
            raise BlockspecError(f"prompt is {len(tokens)} tokens but the context holds {self.target.n_ctx}")

    # ---------------------------------------------------------------- completions
    def create_completion(self, prompt: str | list[int], max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, top_k: int = 40,
                          stop: str | list[str] | None = None, seed: int | None = None, stream: bool = False,
                          model: str | None = None):
        """A text completion of `prompt` (`llama_cpp.Llama.create_completion`'s shape).
        max_tokens None or <= 0: up to the end of the context."""
        sampling = self._sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed)
        head = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model or self.model_path}
        if stream:
            return self._completion_chunks(prompt, max_tokens, sampling, stop, head)
        with self._guard():
            tokens = self._prompt_tokens(prompt)
            out = _Outcome()
            text = "".join(self._texts(tokens, max_tokens, sampling, stop, out))
        return {**head, "choices": [{"text": text, "index": 0, "logprobs": None,
                                     "finish_reason": out.finish_reason}],
                "usage": _usage(len(tokens), out.completion_tokens)}

    def _completion_chunks(self, prompt, max_tokens, sampling, stop, head) -> Iterator[dict]:
        with self._guard():
            tokens = self._prompt_tokens(prompt)
            self._check_fits(tokens)
            out = _Outcome()
            for piece in self._texts(tokens, max_tokens, sampling, stop, out):
                yield {**head, "choices": [{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}]}
            yield {**head, "choices": [{"text": "", "index": 0, "logprobs": None,
                                        "finish_reason": out.finish_reason}]}

    __call__ = create_completion

    def create_chat_completion(self, messages: list[dict], temperature: float = 0.2, top_p: float = 0.95,
                               top_k: int = 40, min_p: float = 0.05, stream: bool = False,
                               stop: str | list[str] | None = None, seed: int | None = None,
                               max_tokens: int | None = None, repeat_penalty: float = 1.0,
                               model: str | None = None):
        """An assistant reply to `messages`, rendered with the GGUF chat template
        (`llama_cpp.Llama.create_chat_completion`'s shape)."""
        sampling = self._sampling(temperature, top_k, top_p, min_p, repeat_penalty, seed)
        head = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": model or self.model_path}
        if stream:
            return self._chat_chunks(messages, max_tokens, sampling, stop, head)
        with self._guard():
            tokens = chat_tokens(self.target, messages)
            out = _Outcome()
            text = "".join(self._texts(tokens, max_tokens, sampling, stop, out))
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": out.finish_reason}],
                "usage": _usage(len(tokens), out.completion_tokens)}

    def _chat_chunks(self, messages, max_tokens, sampling, stop, head) -> Iterator[dict]:
        head = {**head, "object": "chat.completion.chunk"}

        def chunk(delta, finish_reason=None):
            return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish_reason}]}

        with self._guard():
            tokens = chat_tokens(self.target, messages)
            self._check_fits(tokens)
            out = _Outcome()
            yield chunk({"role": "assistant"})
            for piece in self._texts(tokens, max_tokens, sampling, stop, out):
                yield chunk({"content": piece})
            yield chunk({}, out.finish_reason)


def _usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}
