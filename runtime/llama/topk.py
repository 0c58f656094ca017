"""llama.cpp's own top-k, for the sampler chain (runtime/engine/sampling.py).

Top-k keeps exactly k candidates; where logits tie at the k-th place, which of the tied tokens stay
is whatever llama.cpp's partial sort leaves, so the chain asks llama.cpp itself (its top-k sampler
applied to the candidates in id order, as its samplers see them) instead of reimplementing the sort.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

# llama_token_data {int32 id; float logit; float p}, as llama.h lays it out
_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_samplers: dict[int, int] = {}
_ids: dict[int, np.ndarray] = {}  # n_vocab -> ids 0..n-1 (int32), made once
_lock = threading.Lock()


def _sampler(k: int):
    from llama_cpp import llama_cpp

    with _lock:
        if k not in _samplers:
            _samplers[k] = llama_cpp.llama_sampler_init_top_k(k)
        return _samplers[k]


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Token ids llama.cpp's top-k sampler keeps from float32 `logits` [n_vocab] (all of them
    unless 0 < k < n_vocab), best first, equal logits in id order.

    Where fewer than k+1 logits reach the k-th largest value the kept set is unique, whatever
    the sort, and numpy finds it among the logits near the maximum (~25 us for SmolLM2's 49k
    against ~110 us to hand llama.cpp a token array); ties at the k-th place go to llama.cpp."""
    x = np.asarray(logits, dtype=np.float32)
    n = x.shape[0]
    if not 0 < k < n:
        return np.argsort(-x, kind="stable")
    top = x.max()
    for gap in (_gap.get(k, np.float32(np.inf)), np.float32(np.inf)):  # the guess falls short: all
        near = np.flatnonzero(x >= top - gap)
        if len(near) > k:
            break
    else:  # NaN or +inf logits
        return _by_logit(x, llama_top_k(x, k))
    vals = x[near]
    kth = np.partition(vals, len(vals) - k)[len(vals) - k]
    keep = vals >= kth
    _gap[k] = np.float32(2) * (top - kth) + np.float32(1)
    if np.count_nonzero(keep) > k:  # a tie at the k-th place: llama.cpp's sort decides
        return _by_logit(x, llama_top_k(x, k))
    ids, vals = near[keep], vals[keep]
    return ids[np.argsort(-vals, kind="stable")]


def _by_logit(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """`ids` best first, equal logits in id order (llama.cpp's partial sort leaves ties as it may)."""
    return ids[np.lexsort((ids, -x[ids]))]


_gap: dict[int, np.float32] = {}  # k -> how far below the maximum the last k-th logit was, with room


def llama_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """llama.cpp's top-k sampler itself over `logits` [n_vocab] in id order: the kept ids, best first."""
    from llama_cpp import llama_cpp

    x = np.asarray(logits, dtype=np.float32)
    n = x.shape[0]
    if n not in _ids:
        _ids[n] = np.arange(n, dtype=np.int32)
    data = np.empty(n, dtype=_TOKEN_DATA)  # (copying a prepared structured array is 4x slower)
    data["id"] = _ids[n]
    data["logit"] = x
    data["p"] = 0.0
    arr = llama_cpp.llama_token_data_array(
        data=data.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=n, selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(_sampler(k), ctypes.byref(arr))
    return data["id"][:arr.size].copy()
