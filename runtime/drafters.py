"""The drafter interface, and the model-free n-gram (prompt lookup) drafter.

A drafter sees the committed tokens (and, if it asks for them, the target's layer taps
for every committed row) and proposes a `DraftTree` rooted at the last emitted token.
The engine keeps it in step with the target's cache by position:
`trim(n)` forgets everything from position n on, `observe(tokens, start, feats)` adds
committed rows at positions start.. . Acceptance never looks inside a drafter.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from blockspec.runtime.tree import DraftTree


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Drafter:
    name = "base"
    backend: str | None = None  # "torch", "ggml", or None for model-free drafters
    target_layers: tuple[int, ...] = ()  # layer taps this drafter is conditioned on
    max_nodes = 8  # drafted nodes per tree (root excluded): the verify batch is max_nodes + 1
    max_leaves = 1  # sequence ids the tree needs besides the main one

    def check_target(self, target) -> None:
        """Raise BlockspecError naming the mismatch if this drafter cannot serve `target`."""

    def trim(self, n: int) -> None:
        """Forget committed rows at positions >= n."""

    def held_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` this drafter already holds state for. The engine reuses
        at most that much of the target's cached prompt (a model-free drafter needs none)."""
        return len(tokens)

    def observe(self, tokens: Sequence[int], start: int, feats: dict[int, np.ndarray] | None) -> None:
        """Committed rows: tokens at positions start.., with their target taps [n, n_embd] per layer."""

    def propose(self, history: Sequence[int]) -> DraftTree:
        """A tree rooted at history[-1] (the last emitted token, not yet in the cache)."""
        raise NotImplementedError


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from
    `max_ngram` down to `min_ngram`) and propose what followed it (a repeating span is
    continued by its period). With `branches` > 1
    the continuations of several distinct matches are merged into a tree."""

    name = "ngram"

    # min_ngram 3: on 10 of the suite's chat prompts (SmolLM2, 128 tokens) 1-token matches
    # raised tau from 1.46 to 1.64 but cut speed from 1.04x to 0.75x of plain: short matches
    # propose wrong blocks that still cost a wider verify
    def __init__(self, block_size: int = 4, min_ngram: int = 3, max_ngram: int = 3, branches: int = 1):
        if block_size < 1 or branches < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram drafter needs block_size >= 1, branches >= 1, 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.branches = branches
        self.max_nodes = block_size * branches
        self.max_leaves = branches

    def propose(self, history: Sequence[int]) -> DraftTree:
        h = np.asarray(history)
        n_hist = len(h)
        paths: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            suffix = h[n_hist - n:]
            # candidate starts i of an earlier occurrence h[i:i+n] == suffix, latest first
            windows = np.lib.stride_tricks.sliding_window_view(h[:n_hist - 1], n)
            hits = np.nonzero((windows == suffix).all(axis=1))[0][::-1]
            for i in hits:
                # what followed the match; where it runs into the present, the text is
                # periodic with period p and continues by copying itself
                p = n_hist - n - i
                ext = h.tolist()
                for _ in range(self.block_size):
                    ext.append(ext[len(ext) - p])
                cont = ext[n_hist:]
                if not cont or tuple(cont) in seen:
                    continue
                seen.add(tuple(cont))
                paths.append(cont)
                if len(paths) == self.branches:
                    break
            if len(paths) == self.branches:
                break
        return DraftTree.from_paths(int(h[-1]), paths)


class FixedDrafter(Drafter):
    """Proposes a continuation known in advance (e.g. the target's own greedy output);
    for tests of the engine and as an upper bound on acceptance."""

    name = "fixed"

    def __init__(self, continuation: Sequence[int], start: int, block_size: int = 4):
        self.continuation = list(continuation)  # tokens expected at positions start..
        self.start = start
        self.block_size = block_size
        self.max_nodes = block_size

    def propose(self, history: Sequence[int]) -> DraftTree:
        at = len(history) - self.start  # index of the first token after the root
        return DraftTree.chain(int(history[-1]), self.continuation[at: at + self.block_size])


def shipped_drafter(method: str) -> str | None:
    """The trained drafter shipped for the bundled model (models/drafters/, rebuilt by
    `make drafters`), or None. It is paired with the bundled SmolLM2-135M-Instruct Q4_1: any
    other target refuses it at load with the fingerprint check, like every drafter."""
    from importlib.util import find_spec
    from pathlib import Path

    spec = find_spec("blockspec.models")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "drafters" / f"smollm2-135m-{method}.q8_0.gguf"
        if path.is_file():
            return str(path)
    return None


def default_method(model_path: str | None, drafter_path: str | None = None) -> str:
    """`--method` when none is given: the method of `drafter_path` (its GGUF arch or checkpoint
    model_type); without a drafter, plain decoding. The shipped drafters are used by naming their
    method (`--method specblock`); they are not the default because on the 2-core CPU they were
    measured slower than plain decoding (tau ~1.2 at a draft cost of ~0.35 target tokens; see the
    bench) — flip this when a shipped drafter wins its bench."""
    import json
    from pathlib import Path

    from blockspec.runtime.errors import BlockspecError

    if not drafter_path:
        return "plain"
    p = Path(drafter_path)
    try:
        if p.is_dir():
            arch = json.loads((p / "drafter.json").read_text())["model_args"]["model_type"]
        else:
            from blockspec.runtime.gguf_header import GGUFHeader

            arch = GGUFHeader(str(p)).fields["general.architecture"]
    except (OSError, ValueError, KeyError) as e:
        raise BlockspecError(f"cannot tell the drafter's method from {p} ({type(e).__name__}: {e}); "
                             "pass --method") from None
    if arch not in ("specblock", "dblast"):
        raise BlockspecError(f"{p} is a {arch!r} file, not a specblock or dblast drafter")
    return arch


AUTO_NGRAM_DEPTH = 6  # the deepest n-gram draft `--block-size auto` considers


def parse_block_size(value) -> int | str:
    """`--block-size`: a positive number of drafted tokens, or "auto" (runtime/policy.py)."""
    from blockspec.runtime.errors import BlockspecError

    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise BlockspecError(f"--block-size {value!r}: expected a number of tokens >= 1, or auto")
    return n


def make_drafter(method: str, drafter_path: str | None = None, backend: str | None = None,
                 block_size: int | str = 4, branches: int = 1) -> Drafter | None:
    """The drafter for a `--method` (None for plain decoding). block_size "auto": the drafter's
    deepest chain, each step's depth chosen by a measured cost model (runtime/policy.py)."""
    from blockspec.runtime.errors import BlockspecError

    block_size = parse_block_size(block_size)
    if block_size == "auto":
        if branches > 1:
            raise BlockspecError("--block-size auto chooses the depth of a chain: use it with --branches 1")
        from blockspec.runtime.policy import DepthPolicy

        d = make_drafter(method, drafter_path, backend, AUTO_NGRAM_DEPTH if method == "ngram" else 10 ** 6)
        if d is not None:
            d.policy = DepthPolicy(d.block_size)
        return d
    if method == "plain":
        return None
    if method == "ngram":
        return NgramDrafter(block_size=block_size, branches=branches)
    if method in ("specblock", "dblast"):  # need a trained drafter
        drafter_path = drafter_path or shipped_drafter(method)
        if not drafter_path:
            raise BlockspecError(f"--method {method} needs --drafter PATH (a GGUF from `blockspec convert "
                                 f"drafter`, or a checkpoint dir from `blockspec train {method}`)")
        if backend is None:  # a GGUF drafter runs in llama.cpp (SpecBlock: patch 0006; DBlast: dflash + 0008)
            backend = "ggml" if str(drafter_path).endswith(".gguf") else "torch"
        if backend == "ggml":
            from pathlib import Path

            if Path(drafter_path).is_dir():
                raise BlockspecError(f"the ggml backend runs GGUF drafters; {drafter_path} is a checkpoint dir "
                                     f"(convert it with `blockspec convert drafter`, or use --drafter-backend torch)")
            from blockspec.runtime.drafters_ggml import make_ggml_drafter

            return make_ggml_drafter(method, drafter_path, block_size=block_size, branches=branches)
        if backend != "torch":
            raise BlockspecError(f"unknown drafter backend {backend!r} (torch or ggml)")
        from blockspec.runtime.drafters_torch import make_torch_drafter

        return make_torch_drafter(method, drafter_path, block_size=block_size, branches=branches)
    raise BlockspecError(f"unknown method {method!r}; available: {', '.join(METHODS)}")


METHODS = ("plain", "ngram", "specblock", "dblast")
