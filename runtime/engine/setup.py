"""Building what the engine runs: the drafter for a `--method` (one factory for every backend), and
the target opened with the sequences that drafter needs (one place for every front end)."""

from __future__ import annotations

from blockspec.runtime.drafters.base import Drafter
from blockspec.runtime.drafters.ngram import LookupFirst, NgramDrafter


def shipped_drafter(method: str) -> str | None:
    """The trained drafter shipped for the bundled model (models/drafters/, rebuilt by
    `make drafters`), or None. It is paired with the bundled SmolLM2-135M-Instruct Q4_1: any
    other target refuses it at load with the fingerprint check, like every drafter. `ngram`: the
    answer store (`make store`), used only where named (`--drafter`, the bench's `ngram-store`)."""
    from importlib.util import find_spec
    from pathlib import Path

    name = "smollm2-135m-answers.gguf" if method == "ngram" else f"smollm2-135m-{method}.q8_0.gguf"
    spec = find_spec("blockspec.models")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "drafters" / name
        if path.is_file():
            return str(path)
    return None


def default_method(model_path: str | None, drafter_path: str | None = None, adapt: bool = False) -> str:
    """`--method` when none is given: the fastest lossless method measured for what is given, each
    at `--block-size auto` (make_drafter's default for these chains: each step's depth from measured
    costs, 0 = a plain step where drafting does not pay; on a GPU, where a deep verify costs about
    one row, it drafts the whole block).
    - No drafter: the n-gram lookup (`ngram`). It works on any target, and its drafts are
      deterministic, so its output is plain decoding's token for token, greedy or sampled with the
      same seed (sample-and-match draws every token as a plain step does).
    - A drafter: its method (the GGUF arch or checkpoint model_type) with the lookup in front
      (`specblock+ngram`, `dblast+ngram`), or the drafter alone at its block of 4 with `adapt` (the
      adaptation learns from the model drafter's own blocks).
    Bench, 2-core CPU, 256 tokens (README): `ngram-auto` 1.33-1.35x plain at T = 0 and 1.06-1.07x
    at T = 1 (80 prompts); with the shipped drafters `specblock+ngram-auto` 1.36x / 1.05x and
    `dblast+ngram-auto` 1.34x / 1.05x where SpecBlock alone at its block of 4 ran 0.90x / 0.74x (40
    prompts). `--method plain` decodes without a drafter."""
    import json
    from pathlib import Path

    from blockspec.runtime.errors import BlockspecError

    if not drafter_path:
        return "ngram"
    p = Path(drafter_path)
    try:
        if p.is_dir():
            arch = json.loads((p / "drafter.json").read_text())["model_args"]["model_type"]
        else:
            from blockspec.runtime.format.gguf_header import GGUFHeader

            arch = GGUFHeader(str(p)).fields["general.architecture"]
    except (OSError, ValueError, KeyError) as e:
        raise BlockspecError(f"cannot tell the drafter's method from {p} ({type(e).__name__}: {e}); "
                             "pass --method") from None
    from blockspec.runtime.drafters.store import ARCH as STORE_ARCH

    if arch == STORE_ARCH:  # an answer store: the n-gram lookup drafts from it
        return "ngram"
    if arch not in ("specblock", "dblast"):
        raise BlockspecError(f"{p} is a {arch!r} file, not a specblock or dblast drafter")
    return arch if adapt else f"{arch}+ngram"


# the deepest n-gram draft `--block-size auto` considers. Replayed on the target's greedy answers to
# 600 training prompts (`benchmarks/ngram_rules.py --cache DIR`, the README's 2-core curve): 1.211x
# plain, 4 tokens every match 1.176x; a first version's replay (full-depth probes) was slower at 16
AUTO_NGRAM_DEPTH = 8


def parse_block_size(value) -> int | str:
    """`--block-size`: a positive number of drafted tokens, "auto" (runtime/engine/policy.py) or
    "pilot" (runtime/engine/pilot.py)."""
    from blockspec.runtime.errors import BlockspecError

    if str(value).strip().lower() in ("auto", "pilot"):
        return str(value).strip().lower()
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise BlockspecError(f"--block-size {value!r}: expected a number of tokens >= 1, auto or pilot")
    return n


NO_PILOT = "none"  # `--blockpilot none`: auto without the pilot shipped next to the drafter


def _attach_pilot(d, block_size: str, blockpilot: str | None) -> None:
    """Give drafter `d` its BlockPilot (`d.pilot`): `blockpilot` names the GGUF, or None for the one
    next to the drafter. `pilot` requires one; `auto` uses one when there is one."""
    from blockspec.runtime.engine.pilot import Pilot, find_blockpilot, pilot_path_for
    from blockspec.runtime.errors import BlockspecError

    if blockpilot == NO_PILOT:
        if block_size == "pilot":
            raise BlockspecError("--block-size pilot needs a BlockPilot (--blockpilot none turns it off)")
        return
    path = blockpilot or (find_blockpilot(getattr(d, "path", None)) if d is not None else None)
    if path is None:
        if block_size == "pilot":
            if d is None or not getattr(d, "path", None):
                raise BlockspecError("--block-size pilot needs a model drafter (specblock or dblast)")
            raise BlockspecError(f"--block-size pilot: no BlockPilot for drafter {d.path} (looked for "
                                 f"{pilot_path_for(d.path)}; train one with `make blockpilot` or pass --blockpilot)")
        return
    if d is None or not hasattr(d, "set_block_size"):
        raise BlockspecError("a BlockPilot needs a model drafter (specblock or dblast)")
    d.pilot = Pilot(path, d)


def make_drafter(method: str, drafter_path: str | None = None, backend: str | None = None,
                 block_size: int | str | None = None, branches: int = 1, blockpilot: str | None = None) -> Drafter | None:
    """The drafter for a `--method` (None for plain decoding). block_size "auto": the drafter's
    deepest chain, each step's depth chosen by a measured cost model (runtime/engine/policy.py),
    whose acceptance prior comes from the drafter's BlockPilot when it has one; "pilot": the
    block size BlockPilot picks for each request after its prefill (runtime/engine/pilot.py).
    `blockpilot`: the pilot GGUF (None: `<drafter stem>.blockpilot.gguf` next to the drafter;
    "none": no pilot). block_size None: auto for a chain with the n-gram lookup (`ngram`,
    `specblock+ngram`, `dblast+ngram`: default_method's figures), 4 otherwise."""
    from blockspec.runtime.errors import BlockspecError

    if block_size is None:  # the method's default: a chain with the lookup in it picks each step's depth; else a block of 4
        block_size = "auto" if method.endswith("ngram") and branches == 1 else 4
    block_size = parse_block_size(block_size)
    base, plus, extra = method.partition("+")
    if plus:  # `specblock+ngram`: n-gram lookup first, the model drafter elsewhere
        if extra != "ngram" or base not in ("specblock", "dblast"):
            raise BlockspecError(f"unknown method {method!r}: a combined method is specblock+ngram or dblast+ngram")
        # auto: the model drafter's policy, and the lookup's drafts as kinds of their own (policy.py)
        model = make_drafter(base, drafter_path, backend, block_size, branches, blockpilot)
        lookup_size = {"pilot": model.block_size, "auto": AUTO_NGRAM_DEPTH}.get(block_size, block_size)
        d = LookupFirst(model, lookup_size)
        for attr in ("pilot", "policy"):
            if getattr(model, attr, None) is not None:
                setattr(d, attr, getattr(model, attr))
        return d
    if block_size == "auto":
        if branches > 1:
            raise BlockspecError("--block-size auto chooses the depth of a chain: use it with --branches 1")
        from blockspec.runtime.engine.policy import DepthPolicy

        d = make_drafter(method, drafter_path, backend, AUTO_NGRAM_DEPTH if method == "ngram" else 10 ** 6)
        if d is not None:
            d.policy = DepthPolicy(d.block_size)
            if method != "ngram":
                _attach_pilot(d, "auto", blockpilot)
        return d
    if block_size == "pilot":
        d = make_drafter(method, drafter_path, backend, 10 ** 6, branches)  # sized per request by the pilot
        _attach_pilot(d, "pilot", blockpilot)
        return d
    if method == "plain":
        return None
    if method == "ngram":  # with an answer store where one is named (drafters/store.py; not a default:
        # on this CPU it raised tau without raising speed, README "The answer store")
        from blockspec.runtime.drafters.store import load_store

        return NgramDrafter(block_size=block_size, branches=branches,
                            store=load_store(drafter_path) if drafter_path else None)
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
            from blockspec.runtime.drafters.ggml_backend import make_ggml_drafter

            return make_ggml_drafter(method, drafter_path, block_size=block_size, branches=branches)
        if backend != "torch":
            raise BlockspecError(f"unknown drafter backend {backend!r} (torch or ggml)")
        from blockspec.runtime.drafters.torch_backend import make_torch_drafter

        return make_torch_drafter(method, drafter_path, block_size=block_size, branches=branches)
    raise BlockspecError(f"unknown method {method!r}; available: {', '.join(METHODS)}")


METHODS = ("plain", "ngram", "specblock", "dblast", "specblock+ngram", "dblast+ngram")


def open_target_for(model_path, drafters, **config):
    """The target opened for `drafters` (None for plain decoding): its context holds the main
    sequence plus one per leaf of the widest draft tree. `config` goes to `open_target`."""
    from blockspec.runtime.llama.target import open_target

    n_seq_max = 1 + max([d.max_leaves for d in drafters if d is not None] or [0])
    return open_target(model_path, n_seq_max=n_seq_max, **config)


def open_speculative(model_path, method: str, drafter_path: str | None = None, backend: str | None = None,
                     block_size: int | str | None = None, branches: int = 1, blockpilot: str | None = None, **config):
    """(target, drafter) for a `--method`: the drafter first (a bad drafter fails before the target
    loads), then the target opened for it. `config` goes to `open_target`."""
    drafter = make_drafter(method, drafter_path, backend, block_size=block_size, branches=branches,
                           blockpilot=blockpilot)
    return open_target_for(model_path, [drafter], **config), drafter
