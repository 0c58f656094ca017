"""Fresh training prompts written by the target itself (`blockspec train prompts`).

An instruct model given its chat template up to the start of a user turn (system prompt included)
continues with a user's question, as it saw them in instruction tuning (the "Magpie" recipe). Sampled
at T = 1 with the runtime's defaults, `n_parallel` questions decoded together per llama.cpp batch
(a KV stream each), a question ends at the turn's end-of-generation token; questions that run past
`max_new` tokens, repeat an earlier one, or are evaluation prompts (MT-Bench, HumanEval) are dropped
and counted. Written as a prompts JSONL (`{"prompt": ...}` per line) that `train data --prompts FILE`
answers. Resumable: each line records its attempt index (its sampling seed is (seed, attempt)); a
rerun continues after the last one written, and a line cut short by a crash is dropped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from blockspec.runtime.errors import BlockspecError

SENTINEL = "\x01blockspec-user-turn\x01"


def user_turn_prefix(target) -> list[int]:
    """The chat template's tokens up to where a user's first message begins."""
    from blockspec.runtime.llama.prompt import render_chat

    text = render_chat(target, [{"role": "user", "content": SENTINEL}])
    if SENTINEL not in text:
        raise BlockspecError(f"{target.path.name}: its chat template does not show the user's message as written")
    prefix = text[:text.index(SENTINEL)]
    bos = target.token_text(target.bos)
    return target.tokenize(prefix, add_special=not (bos and prefix.startswith(bos)), parse_special=True)


def _read_done(path: Path) -> tuple[list[dict], int]:
    """The file's complete lines and its byte length up to them (a torn last line is not counted)."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    rows = []
    for i, line in enumerate(data[:end].splitlines(), start=1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            raise BlockspecError(f"{path}:{i}: not a line `train prompts` wrote") from None
    if any("attempt" not in r or "prompt" not in r for r in rows):
        raise BlockspecError(f"{path}: not a `train prompts` file (no attempt/prompt fields); choose another --out")
    return rows, end


def generate_prompts(target_path: str | os.PathLike, out: str | os.PathLike, n_prompts: int, *, seed: int = 0,
                     n_parallel: int = 32, max_new: int = 128, threads: int = 0, progress: bool = True) -> dict:
    """Write `n_prompts` target-written questions to the JSONL `out` (resuming it); returns a summary."""
    from tqdm import tqdm

    from blockspec.runtime.engine.sampling import SamplingParams, target_distribution
    from blockspec.runtime.llama.target import Target, TargetConfig

    from .data import _norm, eval_prompts
    from .data_engine import stop_on_signals

    path = Path(out)
    rows, end = _read_done(path)
    if path.exists() and end < path.stat().st_size:
        with open(path, "r+b") as f:  # a line cut short by a crash: dropped, its attempt redone
            f.truncate(end)
    seen = {_norm(r["prompt"]) for r in rows}
    attempt = max((int(r["attempt"]) for r in rows), default=-1) + 1
    banned = eval_prompts()
    stats = dict(done_before=len(rows), too_long=0, duplicate=0, eval_dropped=0, empty=0)
    if len(rows) >= n_prompts:
        return dict(out=str(path), prompts=len(rows), new=0, **stats)
    target = Target(target_path, TargetConfig(n_ctx=n_parallel * (max_new + 64), n_batch=max(64, n_parallel),
                                              n_seq_max=n_parallel, n_threads=threads or None, kv_unified=False))
    prefix = user_turn_prefix(target)
    if len(prefix) > 63:  # each sequence's context holds max_new + 64 tokens
        target.close()
        raise BlockspecError(f"{target.path.name}: the user-turn prefix is {len(prefix)} tokens (at most 63)")
    stop_on_signals()  # every written line is whole; the questions in flight are dropped
    sp = SamplingParams(temperature=1.0)
    bar = tqdm(total=n_prompts, initial=len(rows), unit="prompt", desc="target-written prompts", disable=not progress)
    slots: dict[int, dict] = {}  # seq -> {attempt, rng, tokens}
    free = list(range(n_parallel))[::-1]
    t0, n_tok = time.time(), 0

    def keep(slot: dict, ended: bool) -> None:
        if len(rows) >= n_prompts:  # the last batch's other questions: past the count asked for
            return
        text = target.detokenize(slot["tokens"]).strip() if slot["tokens"] else ""
        key = _norm(text)
        why = ("too_long" if not ended else "empty" if not key else "eval_dropped" if key in banned
               else "duplicate" if key in seen else None)
        if why:
            stats[why] += 1
            return
        seen.add(key)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(dict(prompt=text, attempt=slot["attempt"]), ensure_ascii=False) + "\n")
        rows.append(None)
        bar.update(1)

    def step(seq: int, logits: np.ndarray) -> None:
        slot = slots[seq]
        p = target_distribution(logits, sp)
        tok = int(slot["rng"].choice(len(p), p=p))
        if target.is_eog(tok) or len(slot["tokens"]) >= max_new:
            keep(slot, target.is_eog(tok))
            target.remove(seq, 0, -1)
            free.append(seq)
            del slots[seq]
        else:
            slot["tokens"].append(tok)

    try:
        while len(rows) < n_prompts:
            while free:
                seq = free.pop()
                slots[seq] = dict(attempt=attempt, rng=np.random.default_rng([seed, attempt]), tokens=[])
                attempt += 1
                target.remove(seq, 0, -1)
                step(seq, target.prefill(prefix, seq_id=seq))
            if not slots:
                break
            act = sorted(slots)
            target.decode([slots[s]["tokens"][-1] for s in act], [len(prefix) + len(slots[s]["tokens"]) - 1 for s in act],
                          [(s,) for s in act], logits=[True] * len(act))
            logits = target.logits_rows(len(act))
            n_tok += len(act)
            for i, s in enumerate(act):
                step(s, logits[i])
            bar.set_postfix_str(f"{n_tok / (time.time() - t0):.0f} tok/s")
    except KeyboardInterrupt:
        pass
    finally:
        bar.close()
        target.close()
    return dict(out=str(path), prompts=len(rows), new=len(rows) - stats["done_before"], tok_per_s=round(n_tok / max(1e-9, time.time() - t0), 1),
                **stats)
