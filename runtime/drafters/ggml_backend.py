"""Block drafters run inside llama.cpp from a drafter GGUF: SpecBlock in its own arch `specblock`
(ggml_patches/0006), DBlast in upstream's `dflash` arch with patch 0008 (GgmlDFlashDrafter below).
The SpecBlock half is described here.

The drafter is a second llama.cpp context whose `ctx_other` is the target's context: it borrows
the target's token embeddings (and its LM head when the GGUF has no reduced draft vocabulary).
Its KV cache is the drafter cache of models/drafter.py: one row per committed position holding
every layer's context K/V, projected from the conditioning c = cond_norm(fc(target taps)).

  observe(tokens, start, feats)  one *feature batch* (embeddings only, width n_feat * n_embd,
                                 positions start..): writes the new rows' K/V; trim(n) = seq_rm.
  propose(history)               one *block batch* of K rows at positions t+1..t+K, each row
                                 carrying token x[t+1] = history[-1] and the anchor's features
                                 (t = len(history) - 2, the last observed position); the graph's
                                 outputs "draft_logits" [K, Vd] and "rank_logits" [K, n_buckets]
                                 are read with blockspec_get_graph_output, then the block's own
                                 cache rows are removed again.

Drafts are deterministic (q = None), as in the torch backend (runtime/drafters/torch_backend.py), so the
engine's sample-and-match acceptance stays lossless for any tree the drafter picks.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from blockspec.runtime.drafters.base import BlockDrafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.drafter_gguf import check_pairing, read_drafter_header, target_fingerprint
from blockspec.runtime.drafters.tree import DraftTree
from blockspec.runtime.llama.target import float_view

MAIN_SEQ = 0
_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids for the drafter's KV cache


def _raw():
    from llama_cpp import llama_cpp

    return llama_cpp


class GgmlBlockDrafter(BlockDrafter):
    """The context half shared by ggml block drafters: model, drafter context, feature rows.

    Subclasses say which file llama.cpp loads (`model_file`: the drafter GGUF itself, or a form
    made for the target), whether the context borrows the target's tensors (`share_target`) and
    how many drafted tokens a block holds (`n_predict`)."""

    backend = "ggml"
    share_target = True  # ctx_other = the target's context (its embeddings / head)
    causal = True
    writable = False  # weights in buffers of their own (no mmap), so set_tensor may rewrite them

    def __init__(self, path: str | os.PathLike, block_size: int | None = None, n_ctx: int | None = None,
                 n_threads: int | None = None, kv_type: str = "f16", flash_attn: bool = False):
        self.header = h = read_drafter_header(path)
        self.path = h["path"]
        self.name = h["arch"]
        self.target_layers = tuple(h["target_layers"])
        self.n_predict = self.block_predicts(h)
        self.block_size = self.n_predict if block_size is None else max(1, min(int(block_size), self.n_predict))
        self.n_feat = len(self.target_layers) * h["target_dim"]
        self.d2t = h["d2t"]
        if kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(_KV_TYPES)}")
        self._opts = dict(n_ctx=n_ctx, n_threads=n_threads, kv_type=kv_type, flash_attn=flash_attn)
        self._ctx = None
        self._batch = None
        self._model = None
        self._model_path = None
        self._target = None
        super().__init__()
        self._feats = np.zeros((0, self.n_feat), dtype=np.float32)  # rows 0..len(tokens)-1 valid; grows by doubling
        self._load(self.model_file(None))

    @staticmethod
    def block_predicts(header: dict) -> int:
        return int(header["block_size"])

    def model_file(self, target) -> str | None:
        """The GGUF llama.cpp loads for `target` (None: not known before the target is)."""
        return self.path

    def _load(self, path: str | None) -> None:
        from blockspec.runtime.llama.target import clear_llama_errors, install_log_callback, load_error, safe_extra_bufts

        if path is None or path == self._model_path:
            return
        ll = _raw()
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None
        install_log_callback(False)
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = -1
        if self.writable:  # mapped weights would be the file's read-only pages
            mp.load_mode = ll.LLAMA_LOAD_MODE_NONE
        mp.use_extra_bufts = safe_extra_bufts()
        clear_llama_errors()
        self._model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self._model:
            raise BlockspecError(f"llama.cpp could not load drafter {path}: {load_error()}")
        self._model_path = path
        self._target = None

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        ll = _raw()
        if self._batch is not None:
            ll.llama_batch_ext_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None) is not None:
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ weights in place
    def make_writable(self) -> None:
        """Reload the weights into buffers of their own (not the file's read-only mmap), so that
        `set_tensor` can rewrite them (online adaptation, runtime/engine/adapt.py). The context,
        if any, is dropped with the old model; the next check_target opens a new one."""
        if self.writable:
            return
        self.writable = True
        path = self._model_path
        if path is not None:
            ll = _raw()
            if self._ctx is not None:
                ll.llama_batch_ext_free(self._batch)
                ll.llama_free(self._ctx)
                self._ctx = self._batch = None
            self.tokens = []
            self._model_path = None
            self._load(path)

    def _tensor(self, name: str) -> tuple[int, tuple[int, ...], int]:
        """(element count, torch-order shape, ggml type id) of the drafter's own tensor `name`."""
        from blockspec.runtime.llama import ext as llama_ext

        ne = (ctypes.c_int64 * 4)()
        ty = ctypes.c_int32()
        n = llama_ext.blockspec_model_tensor_info(self._model, name.encode(), ne, ctypes.byref(ty))
        if n < 0:
            raise BlockspecError(f"{self.name} drafter {self.path} has no tensor {name!r}")
        dims = [int(x) for x in ne]
        while len(dims) > 1 and dims[-1] == 1:
            dims.pop()
        return int(n), tuple(reversed(dims)), int(ty.value)

    def get_tensor(self, name: str) -> np.ndarray:
        """The drafter's weight `name` as float32 in torch order (dequantized); BlockspecError
        where llama.cpp keeps it in a layout it cannot read back (weights repacked for the CPU)."""
        from blockspec.runtime.llama import ext as llama_ext

        n, shape, _ = self._tensor(name)
        out = np.empty(n, dtype=np.float32)
        rc = llama_ext.blockspec_model_get_tensor(self._model, name.encode(),
                                                  out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        if rc < 0:
            why = {-3: "its type has no float conversion", -4: "its layout cannot be read back (repacked)"}
            raise BlockspecError(f"cannot read drafter tensor {name}: {why.get(rc, f'error {rc}')}")
        return out.reshape(shape)

    def set_tensor(self, name: str, value) -> None:
        """Write float32 `value` (torch order and shape) into the drafter's weight `name` in place,
        converted by llama.cpp to the tensor's own type (q8_0, f16, f32, ...). The next pass uses
        it; nothing is reloaded. Only between passes (the engine calls it between requests)."""
        from blockspec.runtime.llama import ext as llama_ext

        n, shape, _ = self._tensor(name)
        x = np.ascontiguousarray(value, dtype=np.float32)
        if x.size != n or (x.ndim > 1 and tuple(x.shape) != shape):
            raise BlockspecError(f"drafter tensor {name} has shape {list(shape)}, got {list(x.shape)}")
        rc = llama_ext.blockspec_model_set_tensor(self._model, name.encode(),
                                                  x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
        if rc < 0:
            why = {-3: "llama.cpp cannot convert float32 to its type",
                   -4: "it is in a read-only file mapping (make_writable() first)"}
            raise BlockspecError(f"cannot write drafter tensor {name}: {why.get(rc, f'error {rc}')}")

    def refresh_context(self) -> None:
        """Recompute the cached context K/V of every held row from its stored features, after a
        weight update changed fc / cond_norm / wk / wv. Costs one feature pass over the held rows."""
        n = len(self.tokens)
        if self._ctx is None or n == 0:
            return
        self._forget(0)
        self._flush()

    # ------------------------------------------------------------------ target binding
    def check_target(self, target) -> None:
        """Refuse a target this drafter was not made for (vocabulary, width, layers, tokenizer,
        arch: converters/drafter.py check_pairing), then open the drafter context on it."""
        check_pairing(self.header["meta"], target_fingerprint(target.path))
        self._bind(target)

    def _bind(self, target) -> None:
        if self._target is target and self._ctx is not None:
            return
        from blockspec.runtime.llama.target import last_llama_error

        ll = _raw()
        if self._ctx is not None:
            ll.llama_batch_ext_free(self._batch)
            ll.llama_free(self._ctx)
            self._ctx = self._batch = None
        self._load(self.model_file(target))
        o = self._opts
        cp = ll.llama_context_default_params()
        cp.n_ctx = int(o["n_ctx"] or target.n_ctx) + self.n_predict + 1
        cp.n_batch = cp.n_ubatch = 512
        cp.n_seq_max = 1
        threads = o["n_threads"] or getattr(target, "n_threads", None) or int(os.environ.get("BLOCKSPEC_THREADS", 0)) or 1
        cp.n_threads = cp.n_threads_batch = int(threads)
        cp.type_k = cp.type_v = _KV_TYPES[o["kv_type"]]
        cp.flash_attn_type = 1 if o["flash_attn"] else 0
        if self.share_target:
            cp.ctx_other = target.ctx
        self._ctx = ll.llama_init_from_model(self._model, cp)
        if not self._ctx:
            raise BlockspecError(f"llama.cpp could not create a drafter context for {self.path}: "
                                 f"{last_llama_error()}")
        if not self.causal:
            ll.llama_set_causal_attn(self._ctx, False)
        self._batch = ll.llama_batch_ext_init(self._ctx)
        self._n_batch = cp.n_batch
        self._target = target
        self.tokens = []
        self._done = 0  # rows 0.._done-1 are in the drafter's KV cache (see _context)

    # ------------------------------------------------------------------ context
    def _forget(self, n: int) -> None:
        if self._ctx is not None:
            ll = _raw()
            ll.llama_memory_seq_rm(ll.llama_get_memory(self._ctx), MAIN_SEQ, n, -1)
            self._done = min(self._done, n)

    def observe(self, tokens: Sequence[int], start: int, feats: dict[int, np.ndarray] | None) -> None:
        if self._ctx is None:
            raise RuntimeError(f"{self.name} drafter: check_target(target) first (it needs the target's context)")
        super().observe(tokens, start, feats)

    def _context(self, x: np.ndarray, start: int) -> None:
        """Keep the new rows' features; their pass into the KV cache waits for the next block
        (`_flush`): where --block-size auto takes plain steps, the rows of many steps then go
        through the drafter in one batch instead of one pass per step."""
        n = start + x.shape[0]
        if n > len(self._feats):  # amortised: a copy per doubling, not per step
            grown = np.empty((max(n, 2 * len(self._feats), 256), self.n_feat), dtype=np.float32)
            grown[:start] = self._feats[:start]
            self._feats = grown
        self._feats[start:n] = x

    def _flush(self) -> None:
        """Pass the held rows not yet in the KV cache through the drafter, n_batch at a time."""
        n = len(self.tokens)
        for i in range(self._done, n, self._n_batch):
            self._process_features(np.ascontiguousarray(self._feats[i:min(n, i + self._n_batch)]), i)
        self._done = n

    def _anchor(self, history: Sequence[int]) -> int:
        t = super()._anchor(history)
        self._flush()
        return t

    def _process_features(self, x: np.ndarray, p0: int) -> None:
        ll = _raw()
        b = self._batch
        ll.llama_batch_ext_clear(b)
        pos = (ctypes.c_int32 * 4)()
        for i in range(x.shape[0]):
            row = x[i]
            idx = ll.llama_batch_ext_add_embd(b, MAIN_SEQ, ll.llama_embd(
                row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_feat))
            if idx < 0:
                raise RuntimeError(f"{self.name} drafter: llama_batch_ext_add_embd failed ({idx})")
            pos[0] = p0 + i
            ll.llama_batch_ext_set_pos(b, idx, pos)
        rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, b)
        if rc != 0:
            raise RuntimeError(f"{self.name} drafter: feature batch at positions {p0}.. failed ({rc})")

    def _block_pass(self, t: int, tokens: Sequence[int], read, emb=None):
        """One block batch anchored at t: `tokens` at positions t+1.., every row an output (each
        carrying the extra embedding `emb` when given); returns read() of the outputs, after which
        the block's cache rows are removed again."""
        ll = _raw()
        b = self._batch
        ll.llama_batch_ext_clear(b)
        pos = (ctypes.c_int32 * 4)()
        for k, tok in enumerate(tokens):
            idx = ll.llama_batch_ext_add_token(b, MAIN_SEQ, int(tok))
            if idx < 0 or (emb is not None and not ll.llama_batch_ext_set_embd_token(b, idx, emb)):
                raise RuntimeError(f"{self.name} drafter: could not build the block batch ({idx})")
            pos[0] = t + 1 + k
            ll.llama_batch_ext_set_pos(b, idx, pos)
            ll.llama_batch_ext_set_output_logits(b, idx, True)
        try:
            rc = ll.llama_process(self._ctx, ll.LLAMA_PROCESS_TYPE_DECODE, b)
            if rc != 0:
                raise RuntimeError(f"{self.name} drafter: block batch at position {t + 1} failed ({rc})")
            return read()
        finally:
            ll.llama_memory_seq_rm(ll.llama_get_memory(self._ctx), MAIN_SEQ, t + 1, -1)

    def _run_block(self, t: int, last_token: int, n_rows: int, outputs: Sequence[str]) -> dict[str, np.ndarray]:
        """One SpecBlock block batch anchored at t (n_rows rows of x[t+1] with the anchor's
        features): {output name: [n_rows, width] float32}. The rank head runs only when its
        output is asked for (patch 0008)."""
        from blockspec.runtime.llama import ext as llama_ext

        ll = _raw()
        llama_ext.blockspec_set_rank_head(self._ctx, "rank_logits" in outputs)
        row = np.ascontiguousarray(self._feats[t])
        emb = ll.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_feat)

        def read():
            return {name: buf.reshape(n_rows, -1) for name, buf in self._graph_outputs(outputs, n_rows).items()}

        return self._block_pass(t, [last_token] * n_rows, read, emb)

    def _graph_outputs(self, names: Sequence[str], n_rows: int = 1) -> dict[str, np.ndarray]:
        """The last block pass's named graph outputs (blockspec_get_graph_output), flat float32,
        each a whole number of n_rows rows."""
        from blockspec.runtime.llama import ext as llama_ext

        out = {}
        for name in names:
            n = llama_ext.blockspec_get_graph_output(self._ctx, name.encode(), None, 0)
            if n < 0 or n % n_rows:
                raise RuntimeError(f"{self.name} drafter graph has no output {name!r} (a llama.cpp without "
                                   f"blockspec's patches?)")
            buf = np.empty(n, dtype=np.float32)
            llama_ext.blockspec_get_graph_output(self._ctx, name.encode(),
                                                 buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n)
            out[name] = buf
        return out

    def to_target(self, draft_ids: np.ndarray) -> np.ndarray:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]


class GgmlSpecBlockDrafter(GgmlBlockDrafter):
    """SpecBlock in llama.cpp: the greedy chain of the block, or (tree=True) a tree whose width at
    each depth is the rank head's bucket there, grown best-first by draft log-probability up to
    `max_nodes` (the same rule as the torch backend's SpecBlockDrafter)."""

    name = "specblock"

    def __init__(self, path, block_size: int | None = None, tree: bool = False, max_nodes: int = 8, **ctx_opts):
        super().__init__(path, block_size, **ctx_opts)
        if self.header["arch"] != "specblock":
            raise BlockspecError(f"{path} is a {self.header['arch']} drafter, not specblock")
        self.rank_widths = np.asarray(self.header["rank_widths"])
        self.tree = tree
        self.max_nodes = max(1, max_nodes) if tree else self.block_size
        self.max_leaves = self.max_nodes if tree else 1

    def _resized(self) -> None:
        if not self.tree:
            self.max_nodes = self.block_size

    def block_outputs(self, history: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(draft logits [K, Vd], rank logits [K, n_buckets]) of the block rooted at history[-1]."""
        t = self._anchor(history)
        out = self._run_block(t, int(history[-1]), self.block_size, ("draft_logits", "rank_logits"))
        return out["draft_logits"], out["rank_logits"]

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        root, K = int(history[-1]), self.block_size
        if not self.tree:  # a chain needs the draft logits only
            logits = self._run_block(self._anchor(history), root, K, ("draft_logits",))["draft_logits"]
            if sampler is not None:
                return self._sampled_tree(root, [logits], [1] * K, sampler, self.d2t)
            return DraftTree.chain(root, self.to_target(logits.argmax(-1)).tolist())
        logits, rank = self.block_outputs(history)
        widths = self.rank_widths[rank.argmax(-1)]  # [K]
        if sampler is not None:
            return self._sampled_tree(root, [logits], widths, sampler, self.d2t)
        m = logits.max(-1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        cand, cand_lp = [], []
        for k in range(K):
            w = int(min(widths[k], logp.shape[-1]))
            top = np.argpartition(-logp[k], w - 1)[:w]
            top = top[np.argsort(-logp[k, top], kind="stable")]
            cand.append(self.to_target(top).tolist())
            cand_lp.append(logp[k, top].tolist())
        return DraftTree.best_first(root, cand, cand_lp, self.max_nodes)


class GgmlDFlashDrafter(GgmlBlockDrafter):
    """DBlast in llama.cpp, through upstream's `dflash` graph run on the drafter's upstream export
    (converters/upstream_dflash.py, made once per target and cached), with patch 0008's additions:
    q/k norm optional, and for Kz > 1 the category prior and expander. Feature batches as for
    SpecBlock; the block batch is the tokens [x[t+1], MASK x (B-1)] at positions t+1..t+B.

    Kz = 1 (plain DFlash): rows 1..B-1 of the ordinary logits, over the target vocabulary plus the
    mask id (at -inf); the greedy chain. Kz > 1: `branches` categories, the most likely under the
    block's own prior, chosen inside the graph (blockspec_set_branch_z(-1..-n)), each decoded
    greedily from the same pass and merged into one tree: the torch backend's DBlastDrafter with
    z_temperature 0."""

    name = "dblast"
    share_target = False  # the export carries its embeddings and head
    causal = False

    def __init__(self, path, block_size: int | None = None, branches: int = 1, **ctx_opts):
        super().__init__(path, block_size, **ctx_opts)  # loads nothing yet: the export needs the target
        h = self.header
        if h["arch"] != "dblast":
            raise BlockspecError(f"{path} is a {h['arch']} drafter, not dblast")
        self.mask_id = int(h["vocab_size"])
        self.n_categories = int(h.get("n_categories", 1))
        self.branches = max(1, min(int(branches), self.n_categories))
        self.max_nodes = self.block_size * self.branches
        self.max_leaves = self.branches

    def _resized(self) -> None:
        self.max_nodes = self.block_size * self.branches

    @staticmethod
    def block_predicts(header: dict) -> int:
        return int(header["block_size"]) - 1

    def model_file(self, target) -> str | None:
        if target is None:
            return None
        from blockspec.converters.upstream_dflash import cached_export

        return str(cached_export(self.path, Path(target.path)))

    def _block(self, history: Sequence[int], read):
        return self._block_pass(self._anchor(history), [int(history[-1])] + [self.mask_id] * self.n_predict, read)

    def block_logits(self, history: Sequence[int]) -> np.ndarray:
        """Kz = 1: logits [n_predict, V + 1] of the block rooted at history[-1]. Every row of the
        block is an output: with row 0 left out, the first drafted row's logits came back wrong
        (measured)."""
        ll = _raw()

        def read():
            n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self._model))
            rows = []
            for k in range(1, self.n_predict + 1):  # batch indices of the MASK rows
                ptr = ll.llama_get_logits_ith(self._ctx, k)
                if not ptr:
                    raise RuntimeError(f"dblast drafter: no logits for block row {k}")
                rows.append(float_view(ptr, (n_vocab,)))
            return np.stack(rows)  # one copy of the rows, before the next decode

        return self._block(history, read)

    def branch_logits(self, history: Sequence[int], z: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Kz > 1: (prior logits [Kz], branch logits [n, n_predict, Vd]) of the block rooted at
        history[-1], for categories z (default: the `branches` most likely under the prior).
        Logits are over the draft vocabulary (to_target maps ids)."""
        from blockspec.runtime.llama import ext as llama_ext

        want = list(z) if z is not None else [-(i + 1) for i in range(self.branches)]
        arr = (ctypes.c_int32 * len(want))(*want)
        if llama_ext.blockspec_set_branch_z(self._ctx, arr, len(want)) != 0:
            raise BlockspecError(f"dblast drafter: branch categories {want} are neither ids nor -1..-n")

        out = self._block(history, lambda: self._graph_outputs(("category_prior", "branch_logits")))
        return out["category_prior"], out["branch_logits"].reshape(len(want), self.n_predict, -1)

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        root, n_vocab = int(history[-1]), self.mask_id
        if self.n_categories == 1:
            logits = self.block_logits(history)[:self.block_size, :n_vocab]  # the mask id dropped
            if sampler is not None:
                return self._sampled_tree(root, [logits], [1] * self.block_size, sampler, None)
            return DraftTree.chain(root, logits.argmax(-1).tolist())
        _, logits = self.branch_logits(history)
        if sampler is not None:  # the branches' categories as at T = 0; each branch's tokens drawn
            return self._sampled_tree(root, list(logits[:, :self.block_size]), [1] * self.block_size, sampler,
                                      self.d2t)
        paths = self.to_target(logits[:, :self.block_size].argmax(-1))
        return DraftTree.from_paths(root, paths.tolist())


def make_ggml_drafter(method: str, path: str | os.PathLike, block_size: int | None = None,
                      branches: int = 1, **ctx_opts) -> GgmlBlockDrafter:
    """The drafter for `--method specblock --drafter X.gguf --drafter-backend ggml`."""
    h = read_drafter_header(path)
    if h["arch"] != method:
        raise BlockspecError(f"{path} is a {h['arch']} drafter GGUF, not {method}")
    if method == "specblock":  # branches > 1: a rank-head tree of up to block_size * branches nodes
        bs = min(block_size or h["block_size"], h["block_size"])
        return GgmlSpecBlockDrafter(path, block_size, tree=branches > 1, max_nodes=bs * branches, **ctx_opts)
    return GgmlDFlashDrafter(path, block_size, branches=branches, **ctx_opts)
