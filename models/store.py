"""`blockspec train store`: the answer store (runtime/drafters/store.py) from self-distilled caches.

    blockspec train store --data DIR[,DIR..] --target T.gguf --out STORE.gguf [--heldout 200]

The token text of every answer in the caches (`blockspec train data`: the target's own answers to
training prompts; features are not read), each with the last MAX_N tokens of its chat template
before it, so the store also predicts an answer's first tokens. Before writing, the last `heldout`
answers are replayed against a store of the others as serving drafts (the prompt lookup first,
the store where it has no match): the first-token acceptance of each draft kind becomes that
kind's prior for `--block-size auto`. The store written holds every answer.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from blockspec.runtime.drafters.store import MAX_N, SEP, AnswerStore, draft_kind, save_store
from blockspec.runtime.errors import BlockspecError


def cache_answers(data: str, target_path: str) -> list[tuple[list[int], int]]:
    """(prompt + answer tokens, where the answer starts) of each answer in the caches in `data`
    (comma-separated dirs), in cache order. Refuses an evaluation set and a cache another target wrote."""
    from .data import RaggedFeatures
    from .data_engine import file_sha
    from .train import cache_metas

    sha = file_sha(Path(target_path))
    for d, meta in cache_metas(data).items():
        if meta.get("eval_set"):
            raise BlockspecError(f"--data {d}: an evaluation set (`train data --eval-set`); its answers are "
                                 "never stored, only `blockspec train eval` reads it")
        if meta.get("format") != "ragged":
            raise BlockspecError(f"--data {d}: not a self-distilled cache (`blockspec train data`)")
        if meta.get("target_sha") and meta["target_sha"] != sha:
            raise BlockspecError(f"--data {d}: answers of another target ({meta.get('target')}), "
                                 f"not of {target_path}")
    try:
        cache = RaggedFeatures.load(data.split(","))
    except (FileNotFoundError, ValueError) as e:
        raise BlockspecError(f"--data: {e}") from None
    out: list[tuple[list[int], int]] = []
    for i, (n, a) in enumerate(zip(cache.lengths.tolist(), cache.answer_start.tolist())):
        if n > a:
            start = int(cache.start[i])
            out.append((np.asarray(cache.shards[cache.shard_of[i]]["tokens"][start:start + n]).tolist(), a))
    return out


def store_tokens(answers: list[tuple[list[int], int]]) -> np.ndarray:
    """Each answer with the last MAX_N tokens before it (its chat template's header), SEP after it."""
    return np.array([t for seq, a in answers for t in (*seq[max(0, a - MAX_N):], SEP)], np.int32)


def calibrate(store: AnswerStore, answers: list[tuple[list[int], int]], block: int = 4) -> tuple[dict, dict]:
    """Replay serving drafts on `answers` (each from its first answer token, its prompt in the history):
    the prompt lookup where it matches, else the store. Returns ({kind "n,share": first-token
    acceptance}, summary)."""
    from blockspec.runtime.drafters.ngram import NgramDrafter

    drafts, hits = defaultdict(int), defaultdict(int)
    passes = tokens = store_drafts = 0
    for a, i in answers:
        lookup = NgramDrafter(block_size=block)
        while i < len(a):
            hist = a[:i]
            tree = lookup.propose(hist)
            if len(tree) > 1:
                path = tree.tokens[1:]
            else:
                path, n, share = store.propose(hist, block)
                if path:
                    kind = draft_kind(n, share)
                    key = f"{kind[1]},{kind[2]}"
                    drafts[key] += 1
                    hits[key] += path[0] == a[i]
                    store_drafts += 1
            m = 0
            while m < len(path) and i + m < len(a) and path[m] == a[i + m]:
                m += 1
            passes += 1
            tokens += m + 1
            i += m + 1
    calibration = {k: round((hits[k] + 0.5) / (drafts[k] + 1.0), 4) for k in sorted(drafts)}
    summary = dict(passes=passes, tau=round(tokens / max(passes, 1), 4), store_drafts=store_drafts,
                   drafts_by_kind={k: drafts[k] for k in sorted(drafts)})
    return calibration, summary


def build_store(data: str, target_path: str, out: str, heldout: int = 200) -> dict:
    from blockspec.runtime.format.drafter_gguf import target_fingerprint

    t0 = time.perf_counter()
    fp = target_fingerprint(target_path)
    answers = cache_answers(data, target_path)
    if len(answers) <= heldout:
        raise BlockspecError(f"--data holds {len(answers)} answers: need more than --heldout {heldout}")
    held, kept = answers[-heldout:], answers[:-heldout]
    calibration, summary = calibrate(AnswerStore(store_tokens(kept), fp), held) if heldout else ({}, {})
    tokens = store_tokens(answers)
    source = dict(data=[Path(d).name for d in data.split(",")], answers=len(answers), heldout=heldout,
                  heldout_replay=summary)
    save_store(out, tokens, fp, calibration, source)
    return dict(out=str(out), answers=len(answers), tokens=int((tokens != SEP).sum()),
                bytes=Path(out).stat().st_size, calibration=calibration, heldout_replay=summary,
                seconds=round(time.perf_counter() - t0, 1))


def store_cli(data: str, target: str, out: str, heldout: int) -> None:
    print(json.dumps(build_store(data, target, out, heldout)))
