"""BlockPilot labels: the real runtime at every candidate block size, per training prompt.

    blockspec train blockpilot-labels --target T.gguf --method specblock --drafter D.gguf \\
        --prompts sharegpt,pycode --n-prompts 200 --out DIR [--max-tokens 64 --threads 1]

For each training prompt (the prompt sources and the evaluation-prompt filter of `train data`,
models/data_engine.py: MT-Bench and HumanEval prompts are dropped and counted), the engine
(runtime/engine/generate.py) answers it plainly and with the drafter at every candidate block size b,
in an order rotated per prompt so a slow drift of the shared machine hits every b alike. A
`FixedPilot` (runtime/engine/pilot.py) sets b after each prefill, exactly where a BlockPilot acts at
serving time, and keeps the prefill's last-token logits: the input of the pilot (stored float16,
all n_vocab of them).

Block sizes count DRAFTED tokens (the runtime's `--block-size`); the candidates default to
1 .. the drafter's trained block (both shipped drafters draft at most 4 tokens), every one a size
the drafter can draft.

Per prompt and b (index 0 of the b axis is plain decoding, then the candidates in `block_sizes`):
  n_tokens, passes (target passes, the prefill's included), tau (new tokens per target pass),
  tok_s (generated tokens / generation wall time), verify_s, draft_s (seconds over the generation),
  hist [n, nb + 1, n_predict + 1]: target passes that accepted k drafted tokens (the per-step
  accepted lengths as a histogram; the prefill's pass is in hist[..., 0]).
Labels (`labels()`):
- "measured": the b with the most tok_s: the issue's definition; wall-clock on a shared 2-core CPU
  is noisy, so also
- "modelled": the b with the most n_tokens / ((passes - 1) * (V(b) + D(b))), where V(b) and D(b)
  are the target-pass and draft seconds per step at b averaged over the whole label set (the
  machine's cost model): tau at b over the cost of a step at b, free of per-prompt timing noise.
The acceptance c (chance a drafted token is accepted once the ones before it were) pools every b's
histogram: hits = sum of accepted tokens, tries = sum of min(b, a + 1) over the steps.

Shards `labels_00000.safetensors` ... are written atomically (tmp + os.replace); a rerun skips the
prompts already in a shard, so the run resumes after Ctrl-C or a kill.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError

PREFIX = "labels_"
LABEL_KINDS = ("measured", "modelled")


@dataclass
class LabelConfig:
    method: str = "specblock"
    n_prompts: int = 200          # prompts to label (after filters), counted over the whole run
    max_tokens: int = 64          # new tokens per generation
    max_prompt: int = 256         # longer prompts (template included) are skipped
    block_sizes: str = ""         # comma-separated drafted-token counts; "": 1 .. the drafter's trained block
    temperature: float = 0.0      # 0: greedy (tau is then deterministic; only timing is noisy)
    shard_size: int = 16          # prompts per shard
    seed: int = 0                 # T > 0: the sampling seed of prompt i is seed + i
    threads: int = 1              # llama.cpp threads
    n_ctx: int = 1024


# ------------------------------------------------------------------------------------- pure maths

def acceptance_counts(hist: np.ndarray, b: int) -> tuple[float, float]:
    """(hits, tries) of one generation at block size b from its accept histogram (hist[k] = passes
    that accepted k drafted tokens, the prefill's pass in hist[0]): a step that accepted a < b tokens
    judged a + 1 of them, one that accepted all b judged b."""
    h = np.asarray(hist, dtype=np.float64).copy()
    if len(h):
        h[0] = max(h[0] - 1, 0)  # the prefill's pass drafted nothing
    a = np.arange(len(h))
    return float((h * a).sum()), float((h * np.minimum(b, a + 1)).sum())


def pooled_acceptance(hist: np.ndarray, block_sizes: Sequence[int]) -> np.ndarray:
    """Per prompt c = sum hits / sum tries over the candidate sizes: hist [n, nb + 1, K + 1] -> [n]."""
    out = np.zeros(hist.shape[0])
    for i in range(hist.shape[0]):
        hits = tries = 0.0
        for j, b in enumerate(block_sizes):
            h, t = acceptance_counts(hist[i, j + 1], b)
            hits, tries = hits + h, tries + t
        out[i] = hits / tries if tries else 0.0
    return out


def step_costs(lab: dict) -> tuple[np.ndarray, np.ndarray]:
    """The machine's cost model from a label set: (V, D) [nb + 1], seconds of a target pass and of a
    draft per step at each b (index 0: plain, D = 0), pooled over every prompt."""
    steps = np.maximum(lab["passes"] - 1, 0).sum(0).astype(np.float64)  # [nb + 1]
    steps = np.maximum(steps, 1)
    return lab["verify_s"].sum(0) / steps, lab["draft_s"].sum(0) / steps


def modelled_rate(lab: dict, costs: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """[n, nb + 1] tokens/s as if every step cost the label set's average at its b."""
    V, D = costs if costs is not None else step_costs(lab)
    secs = np.maximum(lab["passes"] - 1, 1) * (V + D)[None, :]
    return lab["n_tokens"] / np.maximum(secs, 1e-12)


def best_b(lab: dict, kind: str = "measured", costs=None) -> np.ndarray:
    """Per prompt the index (into block_sizes) of the best candidate by measured or modelled
    tokens/s; ties go to the smaller block."""
    if kind not in LABEL_KINDS:
        raise BlockspecError(f"label {kind!r}: expected one of {', '.join(LABEL_KINDS)}")
    rate = lab["tok_s"] if kind == "measured" else modelled_rate(lab, costs)
    return np.argmax(rate[:, 1:], axis=1)


# ------------------------------------------------------------------------------------- shards

def _shard_paths(out: Path) -> list[Path]:
    return sorted(out.glob(f"{PREFIX}[0-9]*.safetensors"))


def load_labels(label_dir: str | os.PathLike) -> dict:
    """Every shard of a label dir concatenated: {array name: array, "meta": meta.json}."""
    from safetensors.numpy import load_file

    d = Path(label_dir)
    if not (d / "meta.json").is_file():
        raise BlockspecError(f"{d} is not a BlockPilot label dir (no meta.json; make one with "
                             f"`blockspec train blockpilot-labels`)")
    shards = [load_file(str(p)) for p in _shard_paths(d)]
    if not shards:
        raise BlockspecError(f"{d}: no label shards yet")
    lab = {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}
    lab["meta"] = json.loads((d / "meta.json").read_text())
    return lab


class LabelWriter:
    """Labelled prompts -> atomic shards; knows which prompts are done (resume)."""

    def __init__(self, out: Path, meta: dict, shard_size: int):
        from safetensors import safe_open

        self.out, self.shard_size = out, shard_size
        out.mkdir(parents=True, exist_ok=True)
        mp = out / "meta.json"
        if mp.exists():
            old = json.loads(mp.read_text())
            keys = ("target_sha", "drafter_sha", "drafter_arch", "drafter_block_size", "block_sizes", "max_tokens", "max_prompt",
                    "temperature", "seed", "sources", "n_vocab")
            diff = [k for k in keys if old.get(k) != meta.get(k)]
            if diff:
                raise BlockspecError(f"{out}: a label run with other settings is there ({', '.join(diff)} differ); "
                                     f"use another --out")
        tmp = mp.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        os.replace(tmp, mp)
        for p in out.glob(f"{PREFIX}*.tmp"):
            p.unlink()  # a shard cut short by a crash
        self.done: set[int] = set()
        for p in _shard_paths(out):
            with safe_open(str(p), "numpy") as f:
                self.done.update(int(i) for i in f.get_tensor("prompt_idx"))
        self.n_shards = len(_shard_paths(out))
        self.pending: list[dict] = []

    def add(self, row: dict) -> None:
        self.pending.append(row)
        if len(self.pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        from .data_engine import save_shard

        rows, self.pending = self.pending, []
        data = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
        _, self.n_shards = save_shard(self.out, PREFIX, self.n_shards, data)
        self.done.update(int(r["prompt_idx"]) for r in rows)


# ------------------------------------------------------------------------------------- the run

def parse_block_sizes(text: str, n_predict: int) -> list[int]:
    """`--block-sizes`: comma-separated drafted-token counts within 1..n_predict ("": all of them)."""
    if not str(text).strip():
        return list(range(1, n_predict + 1))
    try:
        sizes = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise BlockspecError(f"--block-sizes {text!r}: expected comma-separated integers") from None
    bad = [b for b in sizes if not 1 <= b <= n_predict]
    if bad or not sizes:
        raise BlockspecError(f"--block-sizes {text!r}: the drafter drafts 1..{n_predict} tokens per block "
                             f"(its trained block); {bad or 'none'} outside")
    return sizes


def training_prompts(target, sources: Sequence[str], n_prompts: int, max_prompt: int, done: set[int],
                     stats: dict) -> Iterator[tuple[int, list[int]]]:
    """(prompt index, tokens) of the first `n_prompts` usable training prompts not in `done`, with
    the filters of `train data`: evaluation prompts (MT-Bench, HumanEval), records the chat template
    cannot render and prompts over `max_prompt` tokens are dropped and counted in `stats`."""
    from blockspec.runtime.llama.prompt import chat_tokens

    from .data import _norm, eval_prompts, first_user
    from .data_engine import iter_prompts

    banned = eval_prompts()
    stats.update(eval_prompts_known=len(banned), eval_dropped=0, too_long=0, unrenderable=0)
    n = 0
    for idx, msgs in enumerate(iter_prompts(sources)):
        if n >= n_prompts:
            return
        if _norm(first_user(msgs)) in banned:
            stats["eval_dropped"] += 1
            continue
        if idx in done:
            n += 1
            continue
        try:
            toks = chat_tokens(target, msgs)
        except Exception:  # noqa: BLE001 - a record the chat template cannot render
            stats["unrenderable"] += 1
            continue
        if len(toks) > max_prompt:
            stats["too_long"] += 1
            continue
        n += 1
        yield idx, toks


def label_prompt(target, drafter, tokens: list[int], block_sizes: Sequence[int], cfg: LabelConfig,
                 sampling, rotate: int = 0) -> dict:
    """One prompt: plain decoding and the drafter at every b (order rotated by `rotate`), and the
    prefill's last-token logits. Returns one label row (see the module docstring)."""
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.pilot import FixedPilot

    nb, K = len(block_sizes), int(drafter.n_predict)
    row = dict(n_tokens=np.zeros(nb + 1, np.int32), passes=np.zeros(nb + 1, np.int32),
               tau=np.zeros(nb + 1, np.float32), tok_s=np.zeros(nb + 1, np.float32),
               verify_s=np.zeros(nb + 1, np.float32), draft_s=np.zeros(nb + 1, np.float32),
               hist=np.zeros((nb + 1, K + 1), np.int32))
    logits = None
    order = list(range(nb + 1))
    order = order[rotate % len(order):] + order[:rotate % len(order)]
    for j in order:
        if j == 0:
            g = generate(target, tokens, max_tokens=cfg.max_tokens, sampling=sampling)
        else:
            drafter.pilot = pilot = FixedPilot(block_sizes[j - 1])
            try:
                g = generate(target, tokens, max_tokens=cfg.max_tokens, sampling=sampling, drafter=drafter)
            finally:
                drafter.pilot = None
            if logits is None:
                logits = pilot.logits
        s = g.stats
        row["n_tokens"][j], row["passes"][j], row["tau"][j] = g.n_tokens, s.target_passes, s.tau
        row["tok_s"][j], row["verify_s"][j], row["draft_s"][j] = s.tokens_per_s, s.verify_s, s.draft_s
        h = s.accept_hist[:K + 1]
        row["hist"][j, :len(h)] = h
    row["logits"] = logits.astype(np.float16)
    row["prompt_tokens"] = np.int32(len(tokens))
    return row


def run_labels(target_path: str | os.PathLike, drafter_path: str | None, sources: Sequence[str],
               out_dir: str | os.PathLike, cfg: LabelConfig = LabelConfig(), progress: bool = True) -> dict:
    """Label `cfg.n_prompts` training prompts (resumable); returns a summary with the label
    distribution (measured and modelled) and the seconds spent per prompt."""
    from tqdm import tqdm

    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.engine.setup import NO_PILOT, make_drafter, open_target_for, shipped_drafter

    from .data_engine import file_sha

    if cfg.method not in ("specblock", "dblast"):
        raise BlockspecError(f"--method {cfg.method!r}: BlockPilot labels need a block drafter (specblock or dblast)")
    if cfg.max_tokens < 1 or cfg.n_prompts < 1:
        raise BlockspecError("--max-tokens and --n-prompts must be >= 1")
    drafter_path = drafter_path or shipped_drafter(cfg.method)
    if not drafter_path:
        raise BlockspecError(f"--method {cfg.method} needs --drafter PATH (a drafter GGUF)")
    drafter = make_drafter(cfg.method, drafter_path, block_size=10 ** 6, blockpilot=NO_PILOT)
    sizes = parse_block_sizes(cfg.block_sizes, int(drafter.n_predict))
    out = Path(out_dir)
    target = open_target_for(target_path, [drafter], n_ctx=cfg.n_ctx, n_threads=cfg.threads or None)
    meta = dict(format="blockpilot-labels", target=str(target.path), target_sha=file_sha(Path(target.path)),
                n_vocab=target.n_vocab, drafter=str(drafter_path), drafter_name=Path(drafter_path).name,
                drafter_sha=file_sha(Path(drafter_path)), drafter_arch=drafter.name,
                drafter_block_size=int(drafter.n_predict), block_sizes=sizes, sources=list(sources),
                units="block sizes count drafted tokens (the runtime's --block-size); b axis index 0 = plain",
                **{k: v for k, v in asdict(cfg).items() if k not in ("threads", "n_prompts", "shard_size",
                                                                     "block_sizes", "method")})
    writer = LabelWriter(out, meta, cfg.shard_size)
    stats: dict = dict(done_before=len(writer.done))
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        def _stop(signum, frame):  # a kill stops cleanly too: labelled prompts are written
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, _stop)
    bar = tqdm(total=cfg.n_prompts, initial=min(len(writer.done), cfg.n_prompts), unit="prompt",
               desc=f"blockpilot labels ({drafter.name})", disable=not progress, mininterval=2.0)
    t0, n_new = time.time(), 0
    counts = np.zeros(len(sizes), np.int64)
    try:
        with target:
            try:
                drafter.check_target(target)
                for idx, toks in training_prompts(target, sources, cfg.n_prompts, cfg.max_prompt, writer.done,
                                                  stats):
                    sampling = SamplingParams(temperature=cfg.temperature, seed=cfg.seed + idx)
                    row = label_prompt(target, drafter, toks, sizes, cfg, sampling, rotate=idx)
                    row["prompt_idx"] = np.int64(idx)
                    writer.add(row)
                    n_new += 1
                    counts[int(np.argmax(row["tok_s"][1:]))] += 1
                    bar.update(1)
                    bar.set_postfix_str("measured best b " + " ".join(f"{b}:{c}" for b, c in zip(sizes, counts)))
                writer.flush()
            finally:
                drafter.close()  # before the target whose context it borrows
    except KeyboardInterrupt:
        writer.flush()  # labelled prompts are kept; the one in flight is labelled again on resume
        raise
    finally:
        bar.close()
    dt = time.time() - t0
    summary = dict(out=str(out), prompts=len(writer.done), new_prompts=n_new,
                   s_per_prompt=round(dt / n_new, 2) if n_new else None, block_sizes=sizes, **stats)
    if writer.done:
        summary.update(label_summary(load_labels(out)))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def label_summary(lab: dict) -> dict:
    """Label distribution (measured and modelled), mean tau / tok/s per b, the cost model and the
    mean acceptance of a label set."""
    sizes = lab["meta"]["block_sizes"]
    V, D = step_costs(lab)
    out = dict(n=int(len(lab["prompt_idx"])), block_sizes=sizes,
               mean_tau={"plain" if j == 0 else str(b): round(float(lab["tau"][:, j].mean()), 3)
                         for j, b in enumerate([0] + sizes)},
               mean_tok_s={"plain" if j == 0 else str(b): round(float(lab["tok_s"][:, j].mean()), 1)
                           for j, b in enumerate([0] + sizes)},
               verify_ms_per_step={"plain" if j == 0 else str(b): round(1e3 * float(V[j]), 2)
                                   for j, b in enumerate([0] + sizes)},
               draft_ms_per_step={str(b): round(1e3 * float(D[j + 1]), 2) for j, b in enumerate(sizes)},
               mean_acceptance=round(float(pooled_acceptance(lab["hist"], sizes).mean()), 3))
    for kind in LABEL_KINDS:
        c = np.bincount(best_b(lab, kind), minlength=len(sizes))
        out[f"labels_{kind}"] = {str(b): int(n) for b, n in zip(sizes, c)}
    return out
