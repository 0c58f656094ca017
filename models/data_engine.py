"""Self-distillation data on the patched llama.cpp: the target answers training prompts itself.

    blockspec train data --target T.gguf --prompts sharegpt,chitchat --out DIR [--n-prompts N]

Every drafter learns what the target says, so its training text is the target's own answers:
each prompt (chat template from the GGUF) is prefilled and answered by the quantized target in
llama.cpp, `n_parallel` answers decoded together in one batch per step (a KV stream per sequence,
so each attends over its own cells only). The layer-tap features of every token, prompt and
answer, come from the same passes: exactly the rows the runtime feeds the drafter. A share of the
answers (`sample_frac`) is sampled at T = 1 with the runtime's sampler defaults, the rest greedy.

Cache layout (a `format: ragged` feature cache, read by data.RaggedFeatures): shards
`shard_00000.safetensors` ... (`shard_w1_00000...` for worker 1 of several) holding sequences packed end to end
  tokens [N] int32, feats [N, n*H] f16, greedy [N] int32, top_ids / top_logp [N, k]  (N tokens)
  lengths [S] int32, answer_start [S] int32, prompt_idx [S] int64, sampled [S] int8  (S sequences)
`greedy` / `top_*` at position i: the target's argmax / top-k log-probs (T = 1) for token i + 1;
in the prompt (no logits asked there) `greedy` is the text's next token and top_logp is -30.
Shards are written atomically (tmp + rename); a restart skips the prompts already in a shard, so
the run resumes after Ctrl-C, a crash or a full disk with every written shard valid.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError

TAP_ARCHS = ("llama", "qwen2", "qwen3")  # graphs that set the layer taps (qwen2: patch 0002)
MIN_FREE_BYTES = 1 << 30  # stop cleanly when the disk has less than this left


@dataclass
class EngineConfig:
    n_prompts: int = 1000          # prompts to answer (after filters), counted over the whole run
    n_parallel: int = 32           # answers decoded together per llama.cpp batch
    max_prompt: int = 256          # longer prompts (template included) are skipped
    min_prompt: int = 0            # shorter ones too: a run over what an earlier --max-prompt skipped
    max_new: int = 256             # answer tokens per prompt at most
    sample_frac: float = 0.25      # share of answers sampled (T = 1, runtime defaults), rest greedy
    top_k: int = 8                 # target log-probs stored per position
    shard_size: int = 64           # sequences per shard
    seed: int = 0
    threads: int = 0               # llama.cpp threads (0: all cores)
    worker: int = 0                # this process answers the prompts with index % workers == worker:
    workers: int = 1               # several one-thread workers beat one many-thread run on a shared CPU
    eval_set: bool = False         # answer evaluation prompts for `train eval` only: the trainer refuses it


# ------------------------------------------------------------------------------------- prompts

def _prompt_messages(conv: list[dict], turn: int = 1) -> list[dict] | None:
    """A conversation -> the messages up to and including its `turn`-th user turn (None if it has
    fewer): turn 2 asks the target the conversation's second question, after its first exchange."""
    out, seen = [], 0
    for m in conv:
        out.append({"role": m["role"], "content": m["content"]})
        seen += m["role"] == "user"
        if seen == turn:
            return out
    return None


def _source_name(spec: str) -> str:
    """`SOURCE:N` -> SOURCE."""
    return spec.rpartition(":")[0] if re.fullmatch(r".+:\d+", spec) else spec


def _conversation_turn(name: str) -> tuple[str, int]:
    """`sharegpt-turn2` -> ("sharegpt", 2): a conversation source asked at a later user turn."""
    m = re.fullmatch(r"(.+)-turn(\d+)", name)
    return (m.group(1), max(1, int(m.group(2)))) if m else (name, 1)


def iter_prompts(sources: Sequence[str]) -> Iterator[list[dict]]:
    """Prompt messages, round-robin over the sources: `sharegpt`, `chitchat`, `pycode` (pip packages,
    the stdlib) or a JSONL file ("prompt" string or "messages" list per line; a bad line is a one-line
    error). `SOURCE:N` starts that source at its N-th record, so a new run takes fresh prompts;
    `sharegpt-turn2` (any conversation source) asks each conversation's second question instead,
    after its first exchange; conversations with one user turn are skipped."""
    return (msgs for _, msgs in tagged_prompts(sources))


def prompt_source_names(sources: Sequence[str], n: int) -> list[str]:
    """The source name of each of the first n prompts `iter_prompts(sources)` yields (a cache's
    `prompt_idx` indexes them)."""
    import itertools

    return [name for name, _ in itertools.islice(tagged_prompts(sources), n)]


def tagged_prompts(sources: Sequence[str]) -> Iterator[tuple[str, list[dict]]]:
    """(source name, prompt messages) in `iter_prompts`' order."""
    import functools
    import itertools

    from blockspec.runtime.bench.run import PROMPT_SETS, load_prompts

    from . import data

    its = []
    for spec in sources:
        s = _source_name(spec)
        start = spec[len(s) + 1:] or "0"
        conv, turn = _conversation_turn(s)
        if conv in data.SOURCES:
            it = map(functools.partial(_prompt_messages, turn=turn), data.SOURCES[conv]())
        elif s in PROMPT_SETS:
            it = iter(load_prompts(s))
        else:
            if not Path(s).is_file():
                raise BlockspecError(f"--prompts {s}: not a file, nor one of {', '.join(data.SOURCES)}")
            it = iter(load_prompts(s))
        its.append(zip(itertools.repeat(s), itertools.islice(it, int(start), None)))
    yield from ((s, msgs) for s, msgs in data.round_robin(its) if msgs)


# ------------------------------------------------------------------------------------- engine

class Slot:
    """One sequence being answered in KV stream `seq`."""

    def __init__(self, seq: int, idx: int, prompt: list[int], sampled: bool, rng):
        self.seq, self.idx, self.sampled, self.rng = seq, idx, sampled, rng
        self.tokens = list(prompt)
        self.n_prompt = len(prompt)
        self.feats: list[np.ndarray] = []   # [n, F] per decode, rows for tokens[0 .. len-2]
        self.greedy: list[int] = []          # for positions n_prompt-1 ..
        self.top_ids: list[np.ndarray] = []
        self.top_logp: list[np.ndarray] = []

    def arrays(self, k: int) -> dict:
        L, n_p = len(self.tokens), self.n_prompt
        F = self.feats[0].shape[1]
        feats = np.zeros((L, F), np.float16)
        rows = np.concatenate(self.feats)
        feats[:len(rows)] = rows  # the last token is never decoded: no row (a block never reads it)
        greedy = np.zeros(L, np.int32)
        greedy[:n_p - 1] = self.tokens[1:n_p]
        greedy[n_p - 1:n_p - 1 + len(self.greedy)] = self.greedy
        top_ids = np.zeros((L, k), np.int32)
        top_logp = np.full((L, k), -30.0, np.float16)
        top_ids[n_p - 1:n_p - 1 + len(self.greedy)] = np.stack(self.top_ids)
        top_logp[n_p - 1:n_p - 1 + len(self.greedy)] = np.stack(self.top_logp)
        return dict(tokens=np.asarray(self.tokens, np.int32), feats=feats, greedy=greedy, top_ids=top_ids,
                    top_logp=top_logp)


def top_k_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n, V] logits -> argmax [n], top-k ids [n, k] (descending), their log-probs (T = 1)."""
    x = logits.astype(np.float32, copy=False)
    m = x.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(-1))
    part = np.argpartition(-x, k - 1, axis=-1)[:, :k]
    vals = np.take_along_axis(x, part, -1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids = np.take_along_axis(part, order, -1)
    logp = np.take_along_axis(vals, order, -1) - lse[:, None]
    return x.argmax(-1).astype(np.int32), ids.astype(np.int32), logp.astype(np.float16)


class ShardWriter:
    """Finished sequences -> atomic shards; knows which prompts are done (resume)."""

    def __init__(self, out: Path, meta: dict, shard_size: int, prefix: str = "shard_"):
        self.out, self.shard_size, self.prefix = out, shard_size, prefix
        out.mkdir(parents=True, exist_ok=True)
        mp = out / "meta.json"
        if mp.exists():
            old = json.loads(mp.read_text())
            keys = ("target_sha", "layers", "max_prompt", "min_prompt", "max_new", "sample_frac", "seed", "top_k",
                    "sources", "eval_set")
            default = asdict(EngineConfig())  # a key an older run did not write had its default then
            diff = [k for k in keys if old.get(k, default.get(k)) != meta.get(k, default.get(k))]
            if diff:
                raise BlockspecError(f"{out}: a data run with other settings is there ({', '.join(diff)} differ); "
                                     f"use another --out")
        write_json(mp, meta)
        self.done: set[int] = set()
        self.n_tokens = self.n_answer = self.bytes = 0
        self.shards: list[Path] = []
        self.scan()
        for p in out.glob(f"{prefix}*.tmp"):
            p.unlink()  # a shard of ours cut short by a crash (other workers' are theirs)
        self.n_own = len(list(out.glob(f"{prefix}[0-9]*.safetensors")))
        self.pending: list[dict] = []

    def scan(self) -> None:
        """Add the shards written since the last scan, any worker's, to the folder's totals: prompts
        done, tokens, answer tokens, bytes."""
        from safetensors import safe_open

        seen = set(self.shards)
        for p in sorted(self.out.glob("shard_*.safetensors")):
            if p in seen:
                continue
            self.shards.append(p)
            with safe_open(str(p), "numpy") as f:
                idx = f.get_tensor("prompt_idx")
                lengths, starts = f.get_tensor("lengths"), f.get_tensor("answer_start")
            self.done.update(int(i) for i in idx)
            self.bytes += p.stat().st_size
            self.n_tokens += int(lengths.sum())
            self.n_answer += int((lengths - starts).sum())

    def add(self, slot: Slot, k: int) -> None:
        a = slot.arrays(k)
        a.update(length=len(slot.tokens), answer_start=slot.n_prompt, prompt_idx=slot.idx, sampled=int(slot.sampled))
        self.pending.append(a)
        if len(self.pending) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return

        seqs, self.pending = self.pending, []
        data = {key: np.concatenate([s[key] for s in seqs]) for key in ("tokens", "feats", "greedy", "top_ids",
                                                                         "top_logp")}
        data.update(lengths=np.array([s["length"] for s in seqs], np.int32),
                    answer_start=np.array([s["answer_start"] for s in seqs], np.int32),
                    prompt_idx=np.array([s["prompt_idx"] for s in seqs], np.int64),
                    sampled=np.array([s["sampled"] for s in seqs], np.int8))
        need = sum(v.nbytes for v in data.values()) + MIN_FREE_BYTES
        if shutil.disk_usage(self.out).free < need:
            raise BlockspecError(f"{self.out}: out of disk ({shutil.disk_usage(self.out).free >> 20} MiB free); "
                                 f"{len(self.shards)} shards kept, rerun to resume")
        _, self.n_own = save_shard(self.out, self.prefix, self.n_own, data)
        self.scan()  # other workers' shards written since count too (the bar and summary are the run's)

    def disk_bytes(self) -> int:
        return self.bytes


def write_json(path: Path, obj) -> None:
    """Write `obj` as JSON atomically; the temporary file is this process's own, so workers
    writing the same file side by side never move each other's."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def save_shard(out: Path, prefix: str, n: int, data: dict) -> tuple[Path, int]:
    """Write `data` atomically (tmp + os.replace) as the first free `<prefix>NNNNN.safetensors` at
    index >= n; returns (path, its index). The feature cache and the BlockPilot labels share it."""
    from safetensors.numpy import save_file

    while (path := out / f"{prefix}{n:05d}.safetensors").exists():
        n += 1
    tmp = path.with_suffix(".tmp")
    save_file(data, str(tmp))
    os.replace(tmp, path)
    return path, n


def file_sha(path: Path) -> str:
    """A cheap identity of a model file (its size and first MiB) for resume checks."""
    import hashlib

    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def stop_on_signals() -> None:
    """Ctrl-C or a kill (SIGTERM; SIGINT too, which a shell ignores in background jobs) raises
    KeyboardInterrupt, so a long data run stops cleanly (from the main thread only)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def run_engine(target_path: str | os.PathLike, sources: Sequence[str], out_dir: str | os.PathLike,
               layers: Sequence[int], cfg: EngineConfig = EngineConfig(), progress: bool = True) -> dict:
    """Answer `cfg.n_prompts` training prompts with the target and cache features + log-probs.
    Returns a summary (prompts done and dropped, tokens, tokens/s, disk use)."""
    from tqdm import tqdm

    from blockspec.runtime.bench.run import PROMPT_SETS
    from blockspec.runtime.llama.prompt import chat_tokens
    from blockspec.runtime.engine.sampling import SamplingParams, target_distribution
    from blockspec.runtime.llama.target import Target, TargetConfig

    from .data import _norm, eval_prompts

    evals = [s for s in sources if _source_name(s) in PROMPT_SETS]
    if evals and not cfg.eval_set:
        raise BlockspecError(f"--prompts {evals[0]}: evaluation prompts are never training data "
                             f"(--eval-set writes a cache only `blockspec train eval` reads)")
    if cfg.min_prompt > cfg.max_prompt:
        raise BlockspecError(f"--min-prompt {cfg.min_prompt}: above --max-prompt {cfg.max_prompt}, no prompt fits")
    if cfg.eval_set:  # greedy answers: what the estimate predicts
        cfg = replace(cfg, sample_frac=0.0)
    out = Path(out_dir)
    n_ctx_seq = cfg.max_prompt + cfg.max_new + 8
    tcfg = TargetConfig(n_ctx=cfg.n_parallel * n_ctx_seq, n_batch=max(cfg.max_prompt, cfg.n_parallel),
                        n_seq_max=cfg.n_parallel, n_threads=cfg.threads or None, kv_unified=False)
    target = Target(target_path, tcfg)
    if target.arch not in TAP_ARCHS:
        raise BlockspecError(f"{target.path.name}: architecture {target.arch!r} has no layer taps "
                             f"(supported: {', '.join(TAP_ARCHS)})")
    target.enable_taps(layers)
    meta = dict(format="ragged", target=str(target.path), target_sha=file_sha(target.path), arch=target.arch,
                layers=list(layers), dim=target.n_embd, n_layer=target.n_layer, vocab_size=target.n_vocab,
                sources=list(sources), **{k: v for k, v in asdict(cfg).items() if k not in ("threads", "n_parallel", "worker", "workers")},
                max_len=n_ctx_seq)
    meta.pop("n_prompts")
    if not 0 <= cfg.worker < cfg.workers:
        raise BlockspecError(f"--worker {cfg.worker}: expected 0..{cfg.workers - 1} (--workers {cfg.workers})")
    writer = ShardWriter(out, meta, cfg.shard_size, "shard_" if cfg.workers == 1 else f"shard_w{cfg.worker}_")
    banned = set() if cfg.eval_set else eval_prompts()
    sp = SamplingParams(temperature=1.0)  # the runtime's defaults at T = 1 (top-k 40, top-p .95, min-p .05)
    stats = dict(eval_prompts_known=len(banned), eval_dropped=0, too_long=0, too_short=0, unrenderable=0,
                 done_before=len(writer.done))

    def prompts() -> Iterator[tuple[int, list[int]]]:
        n = 0
        for idx, msgs in enumerate(iter_prompts(sources)):
            if n >= cfg.n_prompts:
                return
            if any(_norm(m["content"]) in banned for m in msgs if m["role"] == "user"):
                stats["eval_dropped"] += 1
                continue
            if idx in writer.done:
                n += 1
                continue
            try:
                toks = chat_tokens(target, msgs)
            except Exception:  # noqa: BLE001 - a record the chat template cannot render
                stats["unrenderable"] += 1
                continue
            if len(toks) > cfg.max_prompt:
                stats["too_long"] += 1
                continue
            if len(toks) < cfg.min_prompt:
                stats["too_short"] += 1
                continue
            n += 1
            if idx % cfg.workers == cfg.worker:
                yield idx, toks

    stop_on_signals()  # finished answers are written, the ones in flight are redone on resume
    todo = prompts()
    bar = tqdm(total=cfg.n_prompts, initial=len(writer.done), unit="prompt", desc="self-distill",
               disable=not progress, mininterval=2.0)
    slots: dict[int, Slot] = {}
    free = list(range(cfg.n_parallel))[::-1]
    t0, n_new = time.time(), 0

    def record(act: list[Slot], rows: np.ndarray) -> None:
        """Each slot's next token from its row of logits [len(act), V] (greedy/top-k stored there,
        one top-k pass for all rows); a slot that ends is written out."""
        g, ids, logp = top_k_logp(rows, cfg.top_k)
        for i, slot in enumerate(act):
            slot.greedy.append(int(g[i]))
            slot.top_ids.append(ids[i])
            slot.top_logp.append(logp[i])
            if slot.sampled:
                p = target_distribution(rows[i], sp)
                nxt = int(slot.rng.choice(len(p), p=p))
            else:
                nxt = int(g[i])
            slot.tokens.append(nxt)
            if target.is_eog(nxt) or len(slot.tokens) - slot.n_prompt >= cfg.max_new:
                finish(slot)

    def finish(slot: Slot) -> None:
        writer.add(slot, cfg.top_k)
        target.remove(slot.seq, 0, -1)
        free.append(slot.seq)
        del slots[slot.seq]
        bar.update(len(writer.done) + len(writer.pending) - bar.n)  # this answer, and other workers' once written

    def start(idx: int, toks: list[int]) -> None:
        seq = free.pop()
        rng = np.random.default_rng([cfg.seed, idx])
        slot = Slot(seq, idx, toks, bool(rng.random() < cfg.sample_frac), rng)
        target.remove(seq, 0, -1)
        target.prefill(toks, seq_id=seq, on_chunk=lambda chunk: slot.feats.append(
            np.concatenate([target.tap(lid) for lid in layers], -1).astype(np.float16)))
        slots[seq] = slot
        record([slot], target.logits_row(-1)[None])

    def summarize(stopped: bool) -> dict:
        """The folder's totals (every worker's shards) and this run's rate, written to summary.json."""
        writer.scan()
        dt = time.time() - t0
        summary = dict(out=str(out), prompts=len(writer.done), shards=len(writer.shards), tokens=writer.n_tokens,
                       answer_tokens=writer.n_answer, new_answer_tokens=n_new, stopped=stopped,
                       answer_tok_per_s=round(n_new / max(dt, 1e-9), 1), disk_mib=writer.disk_bytes() >> 20, **stats)
        write_json(out / "summary.json", summary)
        return summary

    try:
        exhausted = False
        while True:
            while free and not exhausted:
                item = next(todo, None)
                if item is None:
                    exhausted = True
                    break
                start(*item)
            if not slots:
                break
            act = sorted(slots.values(), key=lambda s: s.seq)
            target.decode([s.tokens[-1] for s in act], [len(s.tokens) - 1 for s in act],
                          [(s.seq,) for s in act], logits=[True] * len(act))
            feats = np.concatenate([target.tap(lid) for lid in layers], -1).astype(np.float16)
            for i, s in enumerate(act):
                s.feats.append(feats[i:i + 1])
            record(act, target.logits_rows(len(act)))  # a view of llama.cpp's rows, read before the next decode
            n_new += len(act)
            dt = time.time() - t0
            bar.set_postfix_str(f"{n_new / dt:.0f} answer tok/s, {writer.disk_bytes() >> 20} MiB")
        writer.flush()
    except KeyboardInterrupt:
        writer.flush()  # finished answers are kept; the ones in flight are answered again on resume
        summarize(stopped=True)  # what the folder holds now, for a run stopped short
        raise
    finally:
        bar.close()
        target.close()
    return summarize(stopped=False)
