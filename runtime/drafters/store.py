"""An answer store: the target's own answers to training prompts, where the n-gram lookup looks when
the context has no match (`--method ngram`; REST-style retrieval from a datastore).

The prompt lookup (drafters/ngram.py) drafts only where the history repeats itself: on the bench's
prompts ~60% of target passes have no 3-token match and decode plainly. A small model's answers
are formulaic across questions ("Here is a Python function that", "    return result\n```"), so the
continuations of the same suffix in the target's answers to other prompts predict what it says
next. The store is the token text of those answers (the data engine's self-distilled caches,
`blockspec train store`), written as a GGUF (architecture `blockspec-store`) with the fingerprint of
the target that wrote them; another target refuses the store with one line. It is used where named
(`--method ngram --drafter STORE.gguf`, the bench's `ngram-store`), not by default: on the 2-core CPU
it raised tau without raising speed (README, "The answer store").

Drafting: the longest suffix of the history (MAX_N down to MIN_N tokens) that occurs in the store;
of up to MAX_OCCURRENCES of its occurrences, the path that most of them continue with, token by
token (a vote). The draft's kind for `--block-size auto` (runtime/engine/policy.py) is
(suffix-length class, vote-share class): each learns its own depth, starting from the first-token
acceptance that class had on held-out answers when the store was built (`calibration`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError

ARCH = "blockspec-store"
MIN_N, MAX_N = 2, 8          # suffix lengths looked up, longest first
MAX_OCCURRENCES = 256        # occurrences of a suffix that vote on its continuation (the latest in the store)
SEP = -1                     # between answers in the token text
_MUL = np.uint64(0x9E3779B97F4A7C15)  # rolling-hash multiplier (odd)
_MASK = (1 << 64) - 1
_POW = [pow(int(_MUL), i, 1 << 64) for i in range(MAX_N)]
SHARE_CLASSES = (0.5, 0.9)   # vote share of the first drafted token: < 0.5, < 0.9, >= 0.9
N_CLASSES = (2, 3, 4)        # suffix length: 2, 3, >= 4


def draft_kind(n: int, share: float) -> tuple[str, int, int]:
    """The policy's kind of a store draft: ("store", suffix-length class, share class)."""
    return ("store", max(c for c in N_CLASSES if c <= n), sum(share >= s for s in SHARE_CLASSES))


class AnswerStore:
    """The token text of the target's answers with a hash index of every MIN_N..MAX_N-gram."""

    def __init__(self, tokens: np.ndarray, fingerprint: dict | None = None, calibration: dict | None = None,
                 path: str | None = None):
        self.tokens = np.concatenate([np.asarray(tokens, np.int64), np.full(MAX_N + 1, SEP, np.int64)])
        self.fingerprint = dict(fingerprint or {})
        self.calibration = dict(calibration or {})  # "n,share" -> first-token acceptance on held-out answers
        self.path = path
        self.n_answers = int((self.tokens == SEP).sum()) - (MAX_N + 1)
        t = self.tokens
        n_tok = len(t) - (MAX_N + 1)
        self._keys: dict[int, np.ndarray] = {}
        self._ends: dict[int, np.ndarray] = {}
        h = np.zeros(n_tok, np.uint64)
        bad = np.zeros(n_tok, bool)
        with np.errstate(over="ignore"):
            for n in range(1, MAX_N + 1):
                tok = t[n - 1:n - 1 + n_tok]
                h = h * _MUL + tok.astype(np.uint64)  # h[i]: hash of t[i:i+n]
                bad |= tok == SEP
                if n >= MIN_N:
                    # a window ending before the last token of the text, without a separator
                    ok = np.flatnonzero(~bad[:n_tok - n])
                    order = np.argsort(h[ok], kind="stable")
                    self._keys[n] = h[ok][order]
                    self._ends[n] = (ok[order] + n).astype(np.int64)  # where the continuation starts

    def __len__(self) -> int:
        return len(self.tokens) - (MAX_N + 1) - self.n_answers

    def prior(self, kind) -> float:
        """The first-token acceptance a kind had on held-out answers (0.5 if not calibrated)."""
        return float(self.calibration.get(f"{kind[1]},{kind[2]}", 0.5))

    def propose(self, history: Sequence[int], k: int) -> tuple[list[int], int, float]:
        """(drafted tokens, suffix length matched, vote share of the first) or ([], 0, 0.0)."""
        h = history
        top = min(MAX_N, len(h))
        # the hash of each suffix length n, as the index computed it: sum of t[-n+j] * MUL^(n-1-j)
        suffix_keys, key = {}, 0
        for n in range(1, top + 1):
            key = (int(h[-n]) * _POW[n - 1] + key) & _MASK
            suffix_keys[n] = key
        for n in range(top, MIN_N - 1, -1):
            key = np.uint64(suffix_keys[n])
            keys = self._keys[n]
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            if hi == lo:
                continue
            ends = self._ends[n][max(lo, hi - MAX_OCCURRENCES):hi]
            suffix = np.asarray(h[len(h) - n:], np.int64)
            ends = ends[(self.tokens[ends[:, None] - n + np.arange(n)] == suffix).all(1)]  # hash collisions
            if not len(ends):
                continue
            at = np.minimum(ends[:, None] + np.arange(k), len(self.tokens) - 1)  # the text ends in SEPs
            rows = self.tokens[at].tolist()  # what followed each occurrence
            path, share = [], 0.0
            for j in range(k):  # the token most of the rows still agreeing go on with (ties: the smaller id)
                votes = Counter(r[j] for r in rows if r[j] != SEP)
                if not votes:
                    break
                tok, count = max(votes.items(), key=lambda kv: (kv[1], -kv[0]))
                if j == 0:
                    share = count / len(rows)
                path.append(tok)
                rows = [r for r in rows if r[j] == tok]
            if path:
                return path, n, float(share)
        return [], 0, 0.0

    def fits(self, fingerprint: dict) -> str | None:
        """None if this store's answers are the target's (same fingerprint), else why not."""
        mine = self.fingerprint
        for field in ("tokenizer_sha256", "n_vocab", "arch", "n_embd", "n_layer"):
            if mine.get(field) and fingerprint.get(field) and str(mine[field]) != str(fingerprint[field]):
                return (f"answer store {self.path or ''} holds the answers of another target "
                        f"({field} {mine[field]} against the target's {fingerprint[field]})")
        return None


# ------------------------------------------------------------------------------------- file format
KEY_N_ANSWERS = f"{ARCH}.n_answers"
KEY_CALIBRATION = f"{ARCH}.calibration"   # JSON: "n_class,share_class" -> first-token acceptance
KEY_SOURCE = f"{ARCH}.source"             # JSON: where the answers came from


def save_store(path: str | os.PathLike, tokens: np.ndarray, fingerprint: dict, calibration: dict,
               source: dict) -> None:
    """Write the store atomically (tmp + rename)."""
    from blockspec.runtime.format.drafter_gguf import gguf_writer, write_fingerprint

    with gguf_writer(path, ARCH) as w:
        w.add_uint32(KEY_N_ANSWERS, int((np.asarray(tokens) == SEP).sum()))
        w.add_string(KEY_CALIBRATION, json.dumps(calibration, sort_keys=True))
        w.add_string(KEY_SOURCE, json.dumps(source, sort_keys=True))
        write_fingerprint(w, fingerprint)
        w.add_tensor("tokens", np.asarray(tokens, np.int32))


def load_store(path: str | os.PathLike) -> AnswerStore:
    """Read a store GGUF and index it; a file that is not one is a one-line error."""
    tokens, fp, calibration = read_store(path)
    return AnswerStore(tokens, fp, calibration, path=str(path))


def read_store(path: str | os.PathLike) -> tuple[np.ndarray, dict, dict]:
    """(token text, target fingerprint, calibration) of a store GGUF, not indexed."""
    from blockspec.runtime.format.drafter_gguf import Keys
    from blockspec.runtime.format.gguf_header import GGUFHeader

    p = Path(path)
    if not p.is_file():
        raise BlockspecError(f"answer store {p} does not exist")
    try:
        h = GGUFHeader(str(p))
        infos = h.tensor_infos()
    except (ValueError, OSError) as e:
        raise BlockspecError(f"{p} is not a readable GGUF file ({e}): truncated or corrupt?") from None
    arch = h.fields.get("general.architecture")
    if arch != ARCH or "tokens" not in infos:
        raise BlockspecError(f"{p} is a {arch!r} GGUF, not an answer store (`blockspec train store`)")
    dims, ttype, off = infos["tokens"]
    if ttype != 26:  # GGML_TYPE_I32
        raise BlockspecError(f"{p}: tokens tensor has ggml type {ttype}, expected I32")
    tokens = np.frombuffer(h.buf, np.int32, count=int(np.prod(dims)), offset=off).copy()
    fp = {field: h.fields.get(key) for field, key in Keys.FINGERPRINT.items()}
    try:
        calibration = json.loads(h.fields.get(KEY_CALIBRATION) or "{}")
    except json.JSONDecodeError:
        raise BlockspecError(f"{p}: malformed {KEY_CALIBRATION}") from None
    h.buf.close()
    return tokens, fp, calibration

