"""Library entry points behind the CLI commands (keyword arguments mirror the options)."""

from __future__ import annotations

from typing import Callable

from blockspec.runtime.engine.adapt import attach_adapter, check_adapt_method
from blockspec.runtime.engine.setup import default_method, open_speculative
from blockspec.runtime.engine.generate import Generation, generate
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.engine.sampling import SamplingParams


def run_generate(prompt: str, *, model: str | None = None, method: str | None = None, drafter: str | None = None,
                 drafter_backend: str | None = None, block_size: int | str | None = None, branches: int = 1, max_tokens: int = 256,
                 temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, seed: int | None = None, raw: bool = False, system: str | None = None,
                 n_ctx: int = 4096, verbose: bool = False, on_text: Callable[[str], None] | None = None,
                 acceptance: str = "rejection", blockpilot: str | None = None, adapt: bool = False) -> Generation:
    """One completion. block_size: drafted tokens per block, "auto" or "pilot" (BlockPilot picks it
    per request; `blockpilot` names its GGUF, default: the one next to the drafter). adapt: SpecBlock's
    online adaptation (runtime/engine/adapt.py; after this one request, the bandit may update)."""
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repeat_penalty=repeat_penalty, seed=seed, acceptance=acceptance)
    method = method or default_method(model, drafter, adapt)
    if adapt:
        check_adapt_method(method)
    target, d = open_speculative(model, method, drafter, drafter_backend, block_size=block_size, branches=branches,
                                 blockpilot=blockpilot, n_ctx=n_ctx, verbose=verbose)
    with target:
        if adapt:
            attach_adapter(d, target)
        tokens = prompt_tokens(target, prompt, raw=raw, system=system)
        return generate(target, tokens, max_tokens=max_tokens, sampling=sampling, drafter=d, on_text=on_text)
