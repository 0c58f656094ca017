"""BlockPilot checkpoint -> GGUF (arch "blockpilot"), and the numpy reader the runtime uses.

Layout (all tensors F32; the whole model is a few tens of KB):
  general.architecture          = "blockpilot"
  blockpilot.feature.kind       = "softmax_summary"  (top-k log-probs, k-1 gaps, entropy of the
                                                       target's last-token softmax after prefill)
  blockpilot.feature.top_k      u32   blockpilot.feature_length  u32 (= 2 * top_k)
  blockpilot.block_count        u32 hidden layers  blockpilot.hidden_length  u32
  blockpilot.activation         = "relu"   blockpilot.residual = true (hidden layers after the first)
  blockpilot.base_block_size    u32 B      blockpilot.block_sizes  i32[] (class i -> block size)
  blockpilot.feat_mean / blockpilot.feat_std   [feature_length] input normalisation
  blockpilot.fc{i}.weight/.bias  i = 0..block_count (the last is the output layer)

`load_blockpilot_gguf(path)` runs the MLP with numpy: it is a handful of tiny matmuls once per
request, which costs microseconds in numpy, while a llama.cpp model + context + graph for it would
cost more to set up than to run (and add a graph to maintain).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.drafter_gguf import gguf_writer

ARCH = "blockpilot"
FEATURE_KIND = "softmax_summary"


def _state_to_gguf(state: dict) -> dict:
    """torch state_dict (numpy values) -> {gguf name: array}."""
    out = {}
    for name, v in state.items():
        if name in ("feat_mean", "feat_std"):
            out[f"{ARCH}.{name}"] = v
        elif name.startswith("fc."):
            _, i, kind = name.split(".")
            out[f"{ARCH}.fc{int(i)}.{kind}"] = v
        else:
            raise BlockspecError(f"blockpilot checkpoint has an unexpected tensor {name!r}")
    return out


def convert_blockpilot(ckpt: str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Checkpoint dir (models/blockpilot.save_checkpoint) or a BlockPilot module -> GGUF."""
    from blockspec.models import blockpilot as bp

    if isinstance(ckpt, bp.BlockPilot):
        model = ckpt
    else:
        d = Path(ckpt)
        if not (d / bp.META).is_file() or not (d / bp.WEIGHTS).is_file():
            raise BlockspecError(f"{d} is not a BlockPilot checkpoint (needs {bp.WEIGHTS} and {bp.META})")
        model, _ = bp.load_checkpoint(d)
    a = model.args
    out = Path(out_path)
    with gguf_writer(out, ARCH) as w:
        w.add_string(f"{ARCH}.feature.kind", FEATURE_KIND)
        w.add_uint32(f"{ARCH}.feature.top_k", a.top_k)
        w.add_uint32(f"{ARCH}.feature_length", a.n_features)
        w.add_uint32(f"{ARCH}.block_count", a.n_layer)
        w.add_uint32(f"{ARCH}.hidden_length", a.hidden_dim)
        w.add_string(f"{ARCH}.activation", "relu")
        w.add_bool(f"{ARCH}.residual", True)
        w.add_uint32(f"{ARCH}.base_block_size", a.base_block_size)
        w.add_array(f"{ARCH}.block_sizes", [int(b) for b in a.block_sizes])
        state = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
        for name, arr in _state_to_gguf(state).items():
            w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    return out


def softmax_summary_np(logits: np.ndarray, top_k: int) -> np.ndarray:
    """numpy twin of models.drafter.softmax_summary: [..., V] -> [..., 2*top_k] float32."""
    x = np.asarray(logits, dtype=np.float32)
    m = x.max(-1, keepdims=True)
    logp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    top = -np.sort(-np.partition(logp, -top_k, axis=-1)[..., -top_k:], axis=-1)
    gaps = top[..., :-1] - top[..., 1:]
    ent = -(np.exp(logp) * logp).sum(-1, keepdims=True)
    return np.concatenate([top, gaps, ent], axis=-1).astype(np.float32)


@dataclass
class BlockPilotGGUF:
    """A BlockPilot MLP read from GGUF; `choose(logits)` -> block size."""

    top_k: int
    block_sizes: list
    base_block_size: int
    weights: list          # [(W [out, in], b [out])] hidden..., output
    feat_mean: np.ndarray
    feat_std: np.ndarray

    def features(self, logits: np.ndarray) -> np.ndarray:
        return softmax_summary_np(logits, self.top_k)

    def scores(self, feats: np.ndarray) -> np.ndarray:
        """feats [..., F] -> scores [..., n_sizes] (float32, as the torch module computes)."""
        x = (np.asarray(feats, dtype=np.float32) - self.feat_mean) / self.feat_std
        for i, (W, b) in enumerate(self.weights[:-1]):
            y = np.maximum(x @ W.T + b, 0.0)
            x = y + x if i > 0 else y
        W, b = self.weights[-1]
        return x @ W.T + b

    def choose(self, logits: np.ndarray) -> int:
        return int(self.block_sizes[int(np.argmax(self.scores(self.features(logits))))])


def load_blockpilot_gguf(path: str | os.PathLike) -> BlockPilotGGUF:
    """Read a blockpilot GGUF; BlockspecError naming the key/tensor when it is not one."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise BlockspecError(f"BlockPilot file {p} does not exist")
    try:
        r = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad file for the user
        raise BlockspecError(f"{p} is not a GGUF file: {e}") from None

    def field(key):
        f = r.fields.get(key)
        if f is None:
            raise BlockspecError(f"{p}: missing GGUF key {key}")
        return f.contents()

    if field("general.architecture") != ARCH:
        raise BlockspecError(f"{p}: general.architecture is {field('general.architecture')!r}, expected {ARCH!r}")
    if field(f"{ARCH}.feature.kind") != FEATURE_KIND:
        raise BlockspecError(f"{p}: unsupported {ARCH}.feature.kind {field(f'{ARCH}.feature.kind')!r}")
    if field(f"{ARCH}.activation") != "relu":
        raise BlockspecError(f"{p}: unsupported {ARCH}.activation {field(f'{ARCH}.activation')!r}")
    tensors = {t.name: np.array(t.data, dtype=np.float32).reshape([int(s) for s in reversed(t.shape)])
               for t in r.tensors}
    n_layer = int(field(f"{ARCH}.block_count"))
    weights = []
    for i in range(n_layer + 1):
        try:
            weights.append((tensors[f"{ARCH}.fc{i}.weight"], tensors[f"{ARCH}.fc{i}.bias"]))
        except KeyError as e:
            raise BlockspecError(f"{p}: missing tensor {e.args[0]}") from None
    top_k = int(field(f"{ARCH}.feature.top_k"))
    sizes = [int(b) for b in field(f"{ARCH}.block_sizes")]
    if weights[0][0].shape[1] != 2 * top_k or weights[-1][0].shape[0] != len(sizes):
        raise BlockspecError(f"{p}: fc shapes do not match feature.top_k={top_k} and {len(sizes)} block sizes")
    return BlockPilotGGUF(top_k=top_k, block_sizes=sizes, base_block_size=int(field(f"{ARCH}.base_block_size")),
                          weights=weights, feat_mean=tensors[f"{ARCH}.feat_mean"].reshape(-1),
                          feat_std=tensors[f"{ARCH}.feat_std"].reshape(-1))
