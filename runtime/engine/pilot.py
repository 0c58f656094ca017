"""BlockPilot at serving time: one look at the prefill's last-token logits per request.

`--block-size pilot`: the pilot (a BlockPilot GGUF, models/blockpilot.py) picks the request's block
size once, right after the prefill, from the target's first next-token logits, and the drafter drafts
that many tokens per block for the whole request. `--block-size auto` with a pilot: the per-step
depth policy (runtime/engine/policy.py) starts from the pilot's predicted acceptance instead of 1/2.
Neither changes the output: verification is lossless for any draft.

The pilot is found next to its drafter (`<drafter stem>.blockpilot.gguf`, e.g.
models/drafters/smollm2-135m-specblock.q8_0.blockpilot.gguf) or named with `--blockpilot PATH`.
A pilot measured on another drafter arch, another block range or another vocabulary is refused
with one line naming the mismatch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from blockspec.runtime.errors import BlockspecError

SUFFIX = ".blockpilot.gguf"


def pilot_path_for(drafter_path: str | None) -> Path:
    """Where the pilot of a drafter file lives: `<dir>/<stem>.blockpilot.gguf` (the stem keeps
    everything but the final `.gguf`)."""
    p = Path(drafter_path)
    return p.with_name((p.name[:-5] if p.name.endswith(".gguf") else p.name) + SUFFIX)


def find_blockpilot(drafter_path: str | None) -> str | None:
    """The pilot shipped next to `drafter_path`, or None."""
    if not drafter_path:
        return None
    p = pilot_path_for(drafter_path)
    return str(p) if p.is_file() else None


class Pilot:
    """A loaded BlockPilot bound to one drafter; `apply(drafter, logits, stats)` after each prefill."""

    def __init__(self, path: str, drafter):
        from blockspec.converters.blockpilot import load_blockpilot_gguf

        self.path = str(path)
        self.model = m = load_blockpilot_gguf(path)
        name = Path(self.path).name
        if m.drafter_arch and m.drafter_arch != drafter.name:
            raise BlockspecError(f"BlockPilot {name} was trained for a {m.drafter_arch} drafter, not {drafter.name} "
                                 f"({Path(drafter.path).name})")
        n_predict = int(getattr(drafter, "n_predict", 0))
        if max(m.block_sizes) > n_predict:
            raise BlockspecError(f"BlockPilot {name} chooses block sizes {m.block_sizes} but drafter "
                                 f"{Path(drafter.path).name} drafts at most {n_predict} tokens per block")

    def predict(self, logits: np.ndarray) -> tuple[int, float]:
        """(block size, predicted acceptance c) from the prefill's last-token logits [V]."""
        m = self.model
        if m.n_vocab and len(logits) != m.n_vocab:
            raise BlockspecError(f"BlockPilot {Path(self.path).name} was trained on a {m.n_vocab}-token vocabulary; "
                                 f"this target has {len(logits)}")
        return m.predict(logits)

    def apply(self, drafter, logits: np.ndarray, stats) -> None:
        """Set this request's block size (no depth policy) or the depth policy's prior (auto)."""
        b, c = self.predict(logits)
        stats.pilot_accept = round(float(c), 4)
        policy = getattr(drafter, "policy", None)
        if policy is not None:
            policy.prior = float(c)
        else:
            stats.block_size = drafter.set_block_size(b)


class FixedPilot:
    """Label generation's pilot (models/blockpilot_data.py): it always picks `block_size` and keeps
    the logits it was shown, so the labels see exactly what a pilot sees at serving time."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.logits: np.ndarray | None = None

    def apply(self, drafter, logits: np.ndarray, stats) -> None:
        self.logits = np.array(logits, dtype=np.float32, copy=True)
        stats.block_size = drafter.set_block_size(self.block_size)
