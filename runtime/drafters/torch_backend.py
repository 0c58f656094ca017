"""Block drafters run in torch (SpecBlock, DBlast) behind the runtime's `Drafter` interface.

The drafter's context is the target's layer inputs at `target_layers` for every committed
position; a `DraftCache` keeps their per-layer K/V. The engine keeps it in step by position:
`observe` runs one pass over the new rows only (a prefill chunk, or root + accepted rows after a
step) and `trim` crops. A block is anchored at the last position with features, t = len(history)-2
(the cache holds 0..t), knows history[-1] = x[t+1] (the root of the tree) and drafts x[t+2]..
(models/drafter.py). Drafts are deterministic (q = None): the engine's sample-and-match
acceptance is lossless for any tree chosen independently of the target's sampling.

The drafter shares the target's token embeddings (and its LM head when the checkpoint has no
reduced draft vocabulary); they are read from the target's GGUF when the drafter is bound to a
target in `check_target`.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Sequence

import numpy as np

from blockspec.models.checkpoint import load_checkpoint
from blockspec.runtime.drafters.base import BlockDrafter
from blockspec.runtime.drafters.tree import DraftTree
from blockspec.runtime.errors import BlockspecError


def _torch():
    import torch

    return torch


@lru_cache(maxsize=2)
def _target_weights(gguf_path: str, mtime: float, need_head: bool):
    """(token embeddings [V, H], LM head [V, H]) of a GGUF as float32 torch tensors; without
    `need_head` (a drafter with its own reduced head) the head slot repeats the embeddings."""
    import torch

    from blockspec.runtime.format.drafter_gguf import read_gguf_tensors

    # not gguf.GGUFReader: its full metadata parse costs seconds for a large vocabulary
    by_name = read_gguf_tensors(gguf_path, ["token_embd.weight", "output.weight"] if need_head else
                                ["token_embd.weight"])
    if "token_embd.weight" not in by_name:
        raise BlockspecError(f"{gguf_path} has no token_embd.weight: the drafter cannot share its embeddings")
    embed = torch.from_numpy(by_name["token_embd.weight"])
    head = torch.from_numpy(by_name["output.weight"]) if "output.weight" in by_name else embed
    return embed, head


class TorchDrafter(BlockDrafter):
    """A loaded SpecBlock/DBlast checkpoint (subclasses draft; this class keeps the context)."""

    backend = "torch"

    def __init__(self, model, meta: dict, path: str | os.PathLike = "", block_size: int | None = None):
        torch = _torch()
        self.model = model.eval().requires_grad_(False)
        self.args = model.args
        self.meta = meta
        self.path = str(path)
        self.name = self.args.model_type
        self.target_layers = tuple(int(lid) for lid in self.args.target_layers)
        self.n_predict = n_predict = int(self.args.n_predict)
        # --block-size caps the drafted tokens per block; the checkpoint fixes the most it can draft
        self.block_size = n_predict if block_size is None else max(1, min(int(block_size), n_predict))
        super().__init__()
        self.cache = model.new_cache()
        self._bound: str | None = None
        self._empty = torch.zeros(1, 0, len(self.target_layers) * self.args.target_dim)

    # ------------------------------------------------------------------ target binding
    def check_target(self, target) -> None:
        a, where = self.args, f"drafter {self.path or self.name}"
        if self.meta.get("format") == "gguf":  # a GGUF drafter records its target's fingerprint
            from blockspec.runtime.format.drafter_gguf import check_pairing, target_fingerprint

            check_pairing(self.meta, target_fingerprint(target.path))
        if target.n_vocab != a.vocab_size:
            raise BlockspecError(f"{where} was trained for a vocabulary of {a.vocab_size} tokens, "
                                 f"the target has {target.n_vocab}")
        if target.n_embd != a.target_dim or target.n_embd != a.dim:
            raise BlockspecError(f"{where} reads target states of width {a.target_dim} (drafter width {a.dim}), "
                                 f"the target's width is {target.n_embd}")
        bad = [lid for lid in self.target_layers if not 0 <= lid < target.n_layer]
        if bad:
            raise BlockspecError(f"{where} reads target layers {list(self.target_layers)}, but the target has "
                                 f"{target.n_layer} layers (0..{target.n_layer - 1}): {bad} out of range")
        fp = self.meta.get("target_fingerprint") or {}
        if fp.get("arch") and fp["arch"] != target.arch:
            raise BlockspecError(f"{where} was trained on a {fp['arch']} target, this target is {target.arch}")
        if fp.get("n_layer") and int(fp["n_layer"]) != target.n_layer:
            raise BlockspecError(f"{where} was trained on a {fp['n_layer']}-layer target, "
                                 f"this target has {target.n_layer} layers")
        self._bind(target)

    def _bind(self, target) -> None:
        path = str(getattr(target, "path", ""))
        if self._bound == path:
            return
        if not path or not os.path.exists(path):
            raise BlockspecError("the torch drafter needs the target's GGUF file to share its embeddings")
        embed, head = _target_weights(path, os.path.getmtime(path), not self.args.draft_vocab_size)
        self.model.bind_target(embed, head)
        self._bound = path
        self.trim(0)  # rows computed against another target mean nothing here

    # ------------------------------------------------------------------ context
    def _forget(self, n: int) -> None:
        self.cache.crop(n)

    def _context(self, x: np.ndarray, start: int) -> None:
        torch = _torch()
        with torch.inference_mode():
            # one pass over the new rows: their conditioning and every layer's context K/V
            self.model.context(self.model.condition(torch.from_numpy(x)[None]), self.cache)

    def _block_inputs(self, history: Sequence[int]):
        """(anchors [1, 1], last token [1, 1]) of the block rooted at history[-1]."""
        torch = _torch()
        return torch.tensor([[self._anchor(history)]]), torch.tensor([[int(history[-1])]])

    def _d2t(self) -> np.ndarray | None:
        """Target id of each draft id (None: the drafter drafts over the target's vocabulary)."""
        if not self.args.draft_vocab_size:
            return None
        if getattr(self, "_d2t_ids", None) is None:  # once: propose asks every step
            self._d2t_ids = self.model.vocab.d2t.numpy().copy()
        return self._d2t_ids

    @classmethod
    def load(cls, path: str | os.PathLike, **options) -> "TorchDrafter":
        """The drafter of the checkpoint dir `path` (its model_type picks the class)."""
        model, meta = load_checkpoint(path)
        kind = DRAFTERS.get(model.args.model_type)
        if kind is None:
            raise BlockspecError(f"{path}: model_type {model.args.model_type!r} is not a drafter "
                                 f"(known: {', '.join(DRAFTERS)})")
        return kind(model, meta, path, **options)


class SpecBlockDrafter(TorchDrafter):
    """SpecBlock: the greedy chain of the block, or (tree=True) a tree whose width at each depth is
    the rank head's bucket there, grown best-first by draft log-probability up to `max_nodes`."""

    def __init__(self, model, meta, path="", block_size: int | None = None, tree: bool = False,
                 max_nodes: int = 8):
        super().__init__(model, meta, path, block_size)
        self.tree = tree
        self.max_nodes = max(1, max_nodes) if tree else self.block_size
        self.max_leaves = self.max_nodes if tree else 1

    def _resized(self) -> None:
        if not self.tree:
            self.max_nodes = self.block_size

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        torch = _torch()
        anchors, last = self._block_inputs(history)
        root, K = int(history[-1]), self.block_size
        with torch.inference_mode():
            out = self.model(self._empty, anchors, last, self.cache)  # cache unchanged: no new rows
        logits = out.logits[0, 0, :K].float()  # [K, Vd]
        if not self.tree and sampler is None:
            return DraftTree.chain(root, self.model.vocab.to_target(logits.argmax(-1)).tolist())
        widths = torch.tensor(self.args.rank_widths)[out.rank_logits[0, 0, :K].argmax(-1)]  # [K]
        if sampler is not None:
            return self._sampled_tree(root, [logits.numpy()], widths.tolist() if self.tree else [1] * K, sampler,
                                      self._d2t())
        logp = torch.log_softmax(logits, dim=-1)
        wmax = int(widths.max())
        top = logp.topk(min(wmax, logp.shape[-1]), dim=-1)
        cand = [self.model.vocab.to_target(top.indices[k, :int(widths[k])]).tolist() for k in range(K)]
        cand_lp = [top.values[k, :int(widths[k])].tolist() for k in range(K)]
        return DraftTree.best_first(root, cand, cand_lp, self.max_nodes)


class DBlastDrafter(TorchDrafter):
    """DBlast: `branches` categories z ~ softmax(prior / z_temperature) (z_temperature 0: the most
    likely ones), each decoded greedily in the same pass; the branches merged into one tree."""

    def __init__(self, model, meta, path="", block_size: int | None = None, branches: int = 1,
                 z_temperature: float = 1.0, seed: int = 0):
        super().__init__(model, meta, path, block_size)
        self.branches = max(1, branches)
        self.z_temperature = z_temperature
        self.generator = _torch().Generator().manual_seed(seed)
        self.max_nodes = self.block_size * self.branches
        self.max_leaves = self.branches

    def _resized(self) -> None:
        self.max_nodes = self.block_size * self.branches

    def propose(self, history: Sequence[int], sampler=None) -> DraftTree:
        torch = _torch()
        anchors, last = self._block_inputs(history)
        with torch.inference_mode():
            logits, _ = self.model.propose_logits(self._empty, anchors, last, self.cache, n_branches=self.branches,
                                                  z_temperature=self.z_temperature, generator=self.generator)
        logits = logits[0, 0, :, :self.block_size].float()  # [n, P, Vd]
        if sampler is not None:
            return self._sampled_tree(int(history[-1]), list(logits.numpy()), [1] * self.block_size, sampler,
                                      self._d2t())
        paths = self.model.vocab.to_target(logits.argmax(-1)).tolist()  # [n, P]
        return DraftTree.from_paths(int(history[-1]), paths)


DRAFTERS = {"specblock": SpecBlockDrafter, "dblast": DBlastDrafter}


def make_torch_drafter(method: str, path: str | os.PathLike, block_size: int | None = None,
                       branches: int = 1) -> TorchDrafter:
    """The drafter for `--method specblock|dblast --drafter PATH`; the checkpoint must be of that kind.
    SpecBlock with branches > 1 drafts a rank-head tree of up to block_size * branches nodes."""
    model, meta = load_checkpoint(path)
    if model.args.model_type != method:
        raise BlockspecError(f"{path} is a {model.args.model_type} checkpoint, not {method}")
    if method == "specblock":
        bs = min(block_size or model.args.n_predict, model.args.n_predict)
        return SpecBlockDrafter(model, meta, path, block_size, tree=branches > 1, max_nodes=bs * branches)
    return DBlastDrafter(model, meta, path, block_size, branches=branches)
