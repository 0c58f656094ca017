"""Target layer taps: the hidden states a drafter is conditioned on.

`Target.enable_taps` + `Target.tap` read them through our patched symbols
(runtime/llama/ext.py). This module gives the one-shot form used by feature
extraction and parity tests.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np


def capture_layer_inputs(model_path: str | os.PathLike, tokens: Sequence[int], layers: Sequence[int],
                         n_ctx: int | None = None) -> dict[int, np.ndarray]:
    """{layer id L: [n_tokens, n_embd] float32 input of layer L} for `tokens` decoded from
    position 0 (L = 0 is the token embedding; 0 <= L < n_layer)."""
    from blockspec.runtime.llama.target import Target, TargetConfig

    tokens = list(tokens)
    n_ctx = n_ctx or max(256, len(tokens) + 1)
    with Target(model_path, TargetConfig(n_ctx=n_ctx, n_batch=min(512, max(32, len(tokens))))) as t:
        return capture_with(t, tokens, layers)


def capture_with(target, tokens: Sequence[int], layers: Sequence[int]) -> dict[int, np.ndarray]:
    """Same as `capture_layer_inputs` on an open Target (its cache is cleared first)."""
    target.enable_taps(layers)
    target.clear()
    rows: dict[int, list[np.ndarray]] = {lid: [] for lid in layers}

    def grab(_chunk):
        for lid in layers:
            rows[lid].append(target.tap(lid))

    target.prefill(list(tokens), on_chunk=grab)
    return {lid: np.concatenate(parts, axis=0) for lid, parts in rows.items()}
