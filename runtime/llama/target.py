"""Owning wrapper around a llama.cpp model + context: the target the runtime drives.

Thin on purpose: it frees native handles, turns return codes into exceptions, and
exposes exactly what decoding needs (tokenize, one batched decode with explicit
positions and sequence ids, logits rows, layer taps, cache trimming). Everything
above it (sampling, drafting, acceptance) is pure Python/numpy.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.modelfile import check_gguf


# Patch 0004: single-token decodes take the same flash-attention path as verify batches,
# so a token's logits do not depend on how many tokens were decoded with it.
os.environ.setdefault("GGML_BATCH_INVARIANT", "1")


def _raw():
    from llama_cpp import llama_cpp

    return llama_cpp


_LOG_LOCK = threading.Lock()
_LOG_STATE = {"installed": False, "verbose": False, "errors": []}


def install_log_callback(verbose: bool) -> None:
    """Route llama.cpp's log through us: silent unless verbose, but keep the last error
    lines so a failed load can say why in one line."""
    ll = _raw()
    with _LOG_LOCK:
        _LOG_STATE["verbose"] = _LOG_STATE["verbose"] or verbose
        if _LOG_STATE["installed"]:
            return

        @ll.llama_log_callback
        def _cb(level, text, _user):
            msg = text.decode("utf-8", "replace") if text else ""
            if level == 4:  # GGML_LOG_LEVEL_ERROR
                _LOG_STATE["errors"] = (_LOG_STATE["errors"] + [msg.strip()])[-5:]
            if _LOG_STATE["verbose"]:
                import sys

                sys.stderr.write(msg)

        _LOG_STATE["cb"] = _cb  # keep the ctypes thunk alive
        ll.llama_log_set(_cb, ctypes.c_void_p(0))
        ll.llama_backend_init()
        _LOG_STATE["installed"] = True


def last_llama_error() -> str:
    errs = [e for e in _LOG_STATE["errors"] if e]
    return errs[-1] if errs else "see --verbose output"


def clear_llama_errors() -> None:
    _LOG_STATE["errors"] = []


def load_error() -> str:
    """llama.cpp's reason for a failed model load (the line naming the bad key or tensor)."""
    for e in _LOG_STATE["errors"]:
        if "error loading model" in e:
            return e.split("error loading model: ")[-1]
    return last_llama_error()


def system_info() -> str:
    return _raw().llama_print_system_info().decode()


def cpu_reports_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_int8" in f.read()
    except OSError:
        return False


def safe_extra_bufts() -> bool:
    """Extra buffer types (weight repacking) crash with SIGILL where the CPU reports AMX
    but the hypervisor does not enable it and the library was built with AMX. Our build
    (ggml_patches/build.py) has AMX off; this guards any other build of the library."""
    return not (cpu_reports_amx() and "AMX_INT8 = 1" in system_info())


class _FloatBuffer:
    """A float32 buffer at an address, by numpy's array interface (np.ctypeslib.as_array builds a
    ctypes array type per shape and goes through the PEP 3118 buffer protocol)."""

    __slots__ = ("__array_interface__",)

    def __init__(self, address: int, shape: tuple[int, ...]):
        self.__array_interface__ = {"data": (address, True), "shape": shape, "typestr": "<f4", "version": 3}


def float_view(ptr, shape: tuple[int, ...]) -> np.ndarray:
    """A read-only [shape] float32 view of the memory `ptr` (a ctypes float pointer) points to."""
    return np.asarray(_FloatBuffer(ctypes.cast(ptr, ctypes.c_void_p).value, tuple(shape)))


@dataclass
class TargetConfig:
    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 1
    n_threads: int | None = None
    n_gpu_layers: int = -1
    # Flash attention on: its CPU kernel gives bit-identical logits for a token whether it is
    # decoded alone or in a batch (the non-FA matmul path does not: up to 1.4 logits apart
    # on SmolLM2), which is what makes batched verification exactly lossless. Tree commits
    # keep cells in position order for it (Target.pack_tail).
    flash_attn: bool = True
    # one KV stream shared by all sequences (a token tree's paths share the prompt's cells); off:
    # a stream per sequence, so independent sequences decoded together (the data engine) each
    # attend over their own cells only
    kv_unified: bool = True
    verbose: bool = False
    cb_eval: object = None  # a llama_cpp.ggml_backend_sched_eval_callback, for debugging and tests


class Target:
    """A GGUF model with one llama.cpp context. Not thread-safe: one decode at a time."""

    def __init__(self, model_path: str | os.PathLike, config: TargetConfig | None = None):
        self.config = cfg = config or TargetConfig()
        self.path = check_gguf(model_path)
        ll = _raw()
        install_log_callback(cfg.verbose)
        self._model = None
        self._ctx = None
        self._batch = None

        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = cfg.n_gpu_layers
        mp.use_extra_bufts = safe_extra_bufts()
        clear_llama_errors()
        self._model = ll.llama_model_load_from_file(str(self.path).encode(), mp)
        if not self._model:
            raise BlockspecError(f"llama.cpp could not load {self.path}: {last_llama_error()}")
        self._vocab = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.n_embd = ll.llama_model_n_embd(self._model)
        self.n_layer = ll.llama_model_n_layer(self._model)
        # the vocabulary's answers, memoised: every emitted token asks both (~50 us a token in ctypes)
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._eog: dict[int, bool] = {}

        cp = ll.llama_context_default_params()
        cp.n_ctx = cfg.n_ctx
        cp.n_batch = cfg.n_batch
        cp.n_ubatch = cfg.n_batch
        cp.n_seq_max = cfg.n_seq_max
        cp.kv_unified = cfg.kv_unified
        # all cores by default; BLOCKSPEC_THREADS overrides (ggml's spinning barriers collapse
        # when another process holds a core, so fewer threads win on a busy machine)
        self.n_threads = cfg.n_threads or int(os.environ.get("BLOCKSPEC_THREADS", 0)) or max(1, os.cpu_count() or 1)
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.flash_attn_type = 1 if cfg.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        if cfg.cb_eval is not None:
            cp.cb_eval = cfg.cb_eval
            cp.cb_eval_user_data = None
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise BlockspecError(f"llama.cpp could not create a context for {self.path}: {last_llama_error()}")
        self.n_ctx = ll.llama_n_ctx(self._ctx)
        self._batch = ll.llama_batch_init(cfg.n_batch, 0, max(1, cfg.n_seq_max))
        self._taps: set[int] = set()
        self._last_n_tokens = 0
        self.cached: list[int] = []  # tokens of seq 0 in the cache, kept by generate_stream

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        ll = _raw()
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            ll.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "Target":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @property
    def ctx(self):
        return self._ctx

    @property
    def model(self):
        return self._model

    # ---------------------------------------------------------------- metadata
    def meta(self, key: str) -> str | None:
        ll = _raw()
        buf = ctypes.create_string_buffer(1 << 16)
        n = ll.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return None if n < 0 else buf.value.decode("utf-8", "replace")

    @property
    def arch(self) -> str:
        return self.meta("general.architecture") or "unknown"

    def chat_template(self) -> str | None:
        tpl = _raw().llama_model_chat_template(self._model, None)
        return tpl.decode("utf-8") if tpl else None

    # ---------------------------------------------------------------- tokens
    @property
    def bos(self) -> int:
        return _raw().llama_vocab_bos(self._vocab)

    @property
    def eos(self) -> int:
        return _raw().llama_vocab_eos(self._vocab)

    def is_eog(self, token: int) -> bool:
        eog = self._eog.get(token)
        if eog is None:
            eog = self._eog[token] = bool(_raw().llama_vocab_is_eog(self._vocab, token))
        return eog

    def token_text(self, token: int) -> str:
        return _raw().llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ll = _raw()
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        piece = self._pieces.get((token, special))
        if piece is None:
            piece = self._pieces[token, special] = self._token_bytes(token, special)
        return piece

    def _token_bytes(self, token: int, special: bool) -> bytes:
        ll = _raw()
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    # ---------------------------------------------------------------- decoding
    def clear(self) -> None:
        _raw().llama_memory_clear(_raw().llama_get_memory(self._ctx), True)
        self.cached = []

    def copy_seq(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Add sequence id `dst` to the cells of `src` at positions [p0, p1) (no data copy
        in a unified cache)."""
        _raw().llama_memory_seq_cp(_raw().llama_get_memory(self._ctx), src, dst, p0, p1)

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Drop cells of `seq_id` (-1: all sequences) at positions [p0, p1)."""
        ok = _raw().llama_memory_seq_rm(_raw().llama_get_memory(self._ctx), seq_id, p0, p1)
        if not ok:
            raise RuntimeError(f"llama_memory_seq_rm(seq={seq_id}, {p0}, {p1}) failed")

    def pack_tail(self, seq_id: int, p0: int) -> int:
        """Move the cells of `seq_id` at positions >= p0 right after position p0 - 1, in
        position order (ggml_patches/0003): the cache then looks as after plain decoding."""
        from blockspec.runtime.llama import ext as llama_ext

        moved = llama_ext.blockspec_memory_pack_tail(self._ctx, seq_id, p0)
        if moved < 0:
            raise RuntimeError(f"blockspec_memory_pack_tail(seq={seq_id}, p0={p0}) failed with {moved}")
        return moved

    def decode(self, tokens: Sequence[int], positions: Sequence[int],
               seq_ids: Sequence[Sequence[int]] | None = None, logits: Sequence[bool] | None = None) -> None:
        """One llama_decode of up to n_batch tokens with explicit positions and sequence ids.

        `logits[i]` asks for the output row of token i (default: the last token only);
        rows are then read with `logits_row(j)` where j counts requested rows in order.
        """
        n = len(tokens)
        if n == 0:
            return
        if n > self.config.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.config.n_batch}")
        b = self._batch
        for i in range(n):
            b.token[i] = tokens[i]
            b.pos[i] = positions[i]
            ids = seq_ids[i] if seq_ids is not None else (0,)
            b.n_seq_id[i] = len(ids)
            for j, s in enumerate(ids):
                b.seq_id[i][j] = s
            b.logits[i] = bool(logits[i]) if logits is not None else (i == n - 1)
        b.n_tokens = n
        rc = _raw().llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} (batch of {n}, positions {positions[0]}..)")
        self._last_n_tokens = n

    def logits_row(self, i: int = -1) -> np.ndarray:
        """Logits of the i-th requested output row of the last decode (-1: last), a copy."""
        return float_view(self.logits_pointer(i), (self.n_vocab,)).copy()

    def logits_pointer(self, i: int = -1):
        """A ctypes float pointer to that row in llama.cpp's buffer (n_vocab floats), valid until this
        context's next decode: for a C call that reads the row in place (sampling.sample_row)."""
        ptr = _raw().llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise RuntimeError(f"no logits for output row {i}")
        return ptr

    def logits_rows(self, n: int) -> np.ndarray:
        """[n, n_vocab] logits of the last decode's n requested rows, in batch order
        (llama_get_logits puts the rows back in batch order first): a read-only view of llama.cpp's
        buffer, valid until this context's next decode; copy what must outlive it (a verify pass
        reads its rows once, right after the decode)."""
        ptr = _raw().llama_get_logits(self._ctx)
        if not ptr:
            raise RuntimeError("no logits from the last decode")
        return float_view(ptr, (n, self.n_vocab))

    # ---------------------------------------------------------------- batch invariance
    @property
    def exact_batch_limit(self) -> int:
        """The largest batch whose logits equal decoding its tokens one at a time, bit for
        bit, on this build, model and thread count. Speculative verification never uses a
        larger batch, which is what keeps its output exactly plain decoding's. Probed once
        and cached under the model cache (a few seconds the first time)."""
        if getattr(self, "_exact_limit", None) is None:
            self._exact_limit = _cached_exact_batch_limit(self)
        return self._exact_limit

    # ---------------------------------------------------------------- layer taps
    def enable_taps(self, layers: Sequence[int]) -> None:
        """Capture the input of each layer in `layers` (0 = token embeddings) on every
        following decode, for all tokens of the batch."""
        from blockspec.runtime.llama import ext as llama_ext

        llama_ext.check_abi()
        for lid in layers:
            if not 0 <= lid < self.n_layer:
                raise ValueError(f"tap layer {lid} outside 0..{self.n_layer - 1}")
        for lid in set(layers) - self._taps:
            llama_ext.blockspec_set_embeddings_layer_inp(self._ctx, lid, True)
        self._taps |= set(layers)

    def tap(self, lid: int, copy: bool = True) -> np.ndarray:
        """[n_tokens_of_last_decode, n_embd] input of layer `lid`: a copy, or (copy=False) a
        read-only view of llama.cpp's buffer, valid until this context's next decode."""
        from blockspec.runtime.llama import ext as llama_ext

        if lid not in self._taps:
            raise ValueError(f"layer {lid} is not tapped; call enable_taps([{lid}]) before decoding")
        if self._last_n_tokens == 0:
            raise RuntimeError("no decode since the taps were enabled")
        ptr = llama_ext.blockspec_get_embeddings_layer_inp(self._ctx, lid)
        if not ptr:
            raise RuntimeError(f"llama.cpp returned no data for tap {lid}")
        rows = float_view(ptr, (self._last_n_tokens, self.n_embd))
        return rows.copy() if copy else rows

    # ---------------------------------------------------------------- prompts
    def prefill(self, tokens: Sequence[int], start: int = 0, seq_id: int = 0,
                on_chunk=None) -> np.ndarray:
        """Decode `tokens` at positions start.. in n_batch chunks; return last-token logits.
        `on_chunk(chunk_tokens)` sees each chunk right after its decode (e.g. to read taps)."""
        if start + len(tokens) > self.n_ctx:
            raise BlockspecError(f"prompt is {len(tokens)} tokens but the context holds {self.n_ctx - start}")
        nb = self.config.n_batch
        for s in range(0, len(tokens), nb):
            chunk = tokens[s:s + nb]
            self.decode(chunk, range(start + s, start + s + len(chunk)), [(seq_id,)] * len(chunk))
            if on_chunk is not None:
                on_chunk(chunk)
        return self.logits_row(-1)


def installed_build() -> dict:
    """The installed wheel's build stamp (key, flags, patches) written by ggml_patches/build.py."""
    import importlib.util
    import json

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return {}
    stamp = Path(list(spec.submodule_search_locations)[0]) / "blockspec_build.json"
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}


PROBE_MAX = 63  # patch 0004: batches under 64 rows take the batch-invariant kernels


def probe_exact_batch_limit(t: Target) -> int:
    """Decode a fixed text one token at a time, then in batches of every size 2..PROBE_MAX (a tree
    may have any number of nodes); return the largest size n such that every batch of up to n
    rows gives logit rows bit-identical to the one-at-a-time rows. Clears the cache."""
    text = ("The quick brown fox jumps over the lazy dog while the cat sleeps on a warm mat. " * 8)
    toks = t.tokenize(text)
    prefix, rest = toks[:8], toks[8:8 + min(PROBE_MAX, t.n_ctx - 9)]
    t.clear()
    t.prefill(prefix)
    ref = []
    for i, tok in enumerate(rest):
        t.decode([tok], [len(prefix) + i])
        ref.append(t.logits_row(-1))
    limit = 1
    for n in range(2, PROBE_MAX + 1):
        if n > len(rest) or n > t.config.n_batch:
            break
        t.clear()
        t.prefill(prefix)
        t.decode(rest[:n], range(len(prefix), len(prefix) + n), logits=[True] * n)
        if not all(np.array_equal(t.logits_row(i), ref[i]) for i in range(n)):
            break
        limit = n
    t.clear()
    return limit


def _cached_exact_batch_limit(t: Target) -> int:
    import json

    from blockspec.runtime.format.modelfile import cache_dir

    st = t.path.stat()
    key = "|".join(map(str, [t.path.resolve(), st.st_size, int(st.st_mtime), installed_build().get("key"),
                             PROBE_MAX, system_info(), t.n_threads,
                             t.config.flash_attn, safe_extra_bufts(), t.config.n_gpu_layers,
                             os.environ.get("GGML_BATCH_INVARIANT")]))
    path = cache_dir() / "exact_batch_limit.json"
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if key not in table:
        table[key] = probe_exact_batch_limit(t)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, path)
    return int(table[key])


def open_target(model_path: str | os.PathLike | None = None, **config) -> Target:
    from blockspec.runtime.format.modelfile import resolve_model

    return Target(resolve_model(model_path), TargetConfig(**config))

