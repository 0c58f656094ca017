"""BlockPilot checkpoint -> GGUF (arch "blockpilot"), and the numpy reader the runtime uses.

Layout (all tensors F32):
  general.architecture          = "blockpilot"
  blockpilot.feature.kind       = "softmax_summary" (top-k log-probs, k-1 gaps, entropy of the
                                  target's last-token softmax after prefill) | "raw" (that softmax
                                  itself, all n_vocab probabilities)
  blockpilot.feature.top_k      u32   blockpilot.feature_length  u32 (summary: 2 * top_k; raw: n_vocab)
  blockpilot.n_vocab            u32 the target vocabulary the pilot was trained on
  blockpilot.drafter.arch       str  the drafter's method (specblock | dblast; absent: not checked)
  blockpilot.drafter.block_size u32  the most tokens that drafter drafts per block (its trained block)
  blockpilot.drafter.name       str  the drafter file the labels came from (information only: a retrained
                                     drafter of the same arch and block is accepted; absent when unknown,
                                     as GGUFWriter writes no empty string)
  blockpilot.block_count        u32 hidden layers  blockpilot.hidden_length  u32
  blockpilot.activation         = "relu"   blockpilot.residual = true (hidden layers after the first)
  blockpilot.base_block_size    u32 B      blockpilot.block_sizes  i32[] (class i -> block size)
  blockpilot.feat_mean / blockpilot.feat_std   [feature_length] input normalisation
  blockpilot.fc{i}.weight/.bias  i = 0..block_count (the last is the output layer)
  blockpilot.accept.weight/.bias [1, hidden] / [1]: logit of c, the chance a drafted token is accepted
                                  once the ones before it were (the prior of `--block-size auto`)

Block sizes count DRAFTED tokens per block, the runtime's `--block-size` (1 = one drafted token
verified with the root in a 2-row target pass).

`load_blockpilot_gguf(path)` runs the MLP with numpy: a handful of tiny matmuls once per request
(microseconds for the summary, ~1 ms for a raw input), where a llama.cpp model + context + graph
would cost more to set up than to run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.drafter_gguf import gguf_writer

ARCH = "blockpilot"
FEATURE_KINDS = ("softmax_summary", "raw")


def _state_to_gguf(state: dict) -> dict:
    """torch state_dict (numpy values) -> {gguf name: array}."""
    out = {}
    for name, v in state.items():
        if name in ("feat_mean", "feat_std"):
            out[f"{ARCH}.{name}"] = v
        elif name.startswith("fc."):
            _, i, kind = name.split(".")
            out[f"{ARCH}.fc{int(i)}.{kind}"] = v
        elif name.startswith("accept."):
            out[f"{ARCH}.{name}"] = v
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
        w.add_string(f"{ARCH}.feature.kind", a.feature_kind)
        w.add_uint32(f"{ARCH}.feature.top_k", a.top_k)
        w.add_uint32(f"{ARCH}.feature_length", a.n_features)
        w.add_uint32(f"{ARCH}.n_vocab", a.n_vocab)
        w.add_string(f"{ARCH}.drafter.arch", a.drafter_arch)
        w.add_uint32(f"{ARCH}.drafter.block_size", a.max_block_size)
        w.add_string(f"{ARCH}.drafter.name", a.drafter_name)
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


def softmax_np(logits: np.ndarray) -> np.ndarray:
    """The raw feature: the softmax of the logits [..., V] (float32)."""
    x = np.asarray(logits, dtype=np.float32)
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


@dataclass
class BlockPilotGGUF:
    """A BlockPilot MLP read from GGUF: `choose(logits)` -> block size, `accept_rate(logits)` -> c."""

    feature_kind: str
    top_k: int
    n_vocab: int
    block_sizes: list
    base_block_size: int
    drafter_arch: str
    drafter_block_size: int
    drafter_name: str
    weights: list          # [(W [out, in], b [out])] hidden..., output
    accept: tuple          # (W [1, hidden], b [1])
    feat_mean: np.ndarray
    feat_std: np.ndarray

    def features(self, logits: np.ndarray) -> np.ndarray:
        if self.feature_kind == "raw":
            return softmax_np(logits)
        return softmax_summary_np(logits, self.top_k)

    def _trunk(self, feats: np.ndarray) -> np.ndarray:
        x = (np.asarray(feats, dtype=np.float32) - self.feat_mean) / self.feat_std
        for i, (W, b) in enumerate(self.weights[:-1]):
            y = np.maximum(x @ W.T + b, 0.0)
            x = y + x if i > 0 else y
        return x

    def scores(self, feats: np.ndarray) -> np.ndarray:
        """feats [..., F] -> scores [..., n_sizes] (float32, as the torch module computes)."""
        W, b = self.weights[-1]
        return self._trunk(feats) @ W.T + b

    def predict(self, logits: np.ndarray) -> tuple[int, float]:
        """(block size, predicted per-token acceptance c) for first next-token logits [V]."""
        h = self._trunk(self.features(logits))
        W, b = self.weights[-1]
        Wa, ba = self.accept
        z = float((h @ Wa.T + ba).reshape(-1)[0])
        c = 0.5 * (1.0 + np.tanh(0.5 * z))  # the sigmoid, without exp's overflow for a large |z|
        return int(self.block_sizes[int(np.argmax(h @ W.T + b))]), c

    def choose(self, logits: np.ndarray) -> int:
        return int(self.block_sizes[int(np.argmax(self.scores(self.features(logits))))])

    def accept_rate(self, logits: np.ndarray) -> float:
        return self.predict(logits)[1]


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

    def field(key, default=None):
        f = r.fields.get(key)
        if f is None:
            if default is not None:
                return default
            raise BlockspecError(f"{p}: missing GGUF key {key}")
        return f.contents()

    if field("general.architecture") != ARCH:
        raise BlockspecError(f"{p}: general.architecture is {field('general.architecture')!r}, expected {ARCH!r}")
    kind = field(f"{ARCH}.feature.kind")
    if kind not in FEATURE_KINDS:
        raise BlockspecError(f"{p}: unsupported {ARCH}.feature.kind {kind!r} (known: {', '.join(FEATURE_KINDS)})")
    if field(f"{ARCH}.activation") != "relu":
        raise BlockspecError(f"{p}: unsupported {ARCH}.activation {field(f'{ARCH}.activation')!r}")
    tensors = {t.name: np.array(t.data, dtype=np.float32).reshape([int(s) for s in reversed(t.shape)])
               for t in r.tensors}

    def tensor(name):
        if name not in tensors:
            raise BlockspecError(f"{p}: missing tensor {name}")
        return tensors[name]

    n_layer = int(field(f"{ARCH}.block_count"))
    weights = [(tensor(f"{ARCH}.fc{i}.weight"), tensor(f"{ARCH}.fc{i}.bias").reshape(-1)) for i in range(n_layer + 1)]
    accept = (tensor(f"{ARCH}.accept.weight").reshape(1, -1), tensor(f"{ARCH}.accept.bias").reshape(-1))
    top_k = int(field(f"{ARCH}.feature.top_k"))
    n_vocab = int(field(f"{ARCH}.n_vocab"))
    n_feat = int(field(f"{ARCH}.feature_length"))
    sizes = [int(b) for b in field(f"{ARCH}.block_sizes")]
    want = 2 * top_k if kind == "softmax_summary" else n_vocab
    if n_feat != want:
        raise BlockspecError(f"{p}: {ARCH}.feature_length is {n_feat}, a {kind} input has {want}")
    if weights[0][0].shape[1] != n_feat or weights[-1][0].shape[0] != len(sizes):
        raise BlockspecError(f"{p}: fc shapes do not match {ARCH}.feature_length={n_feat} and "
                             f"{len(sizes)} {ARCH}.block_sizes")
    if not sizes or min(sizes) < 1:
        raise BlockspecError(f"{p}: {ARCH}.block_sizes {sizes} must be drafted-token counts >= 1")
    return BlockPilotGGUF(feature_kind=kind, top_k=top_k, n_vocab=n_vocab, block_sizes=sizes,
                          base_block_size=int(field(f"{ARCH}.base_block_size")),
                          drafter_arch=str(field(f"{ARCH}.drafter.arch", "")),
                          drafter_block_size=int(field(f"{ARCH}.drafter.block_size")),
                          drafter_name=str(field(f"{ARCH}.drafter.name", "")), weights=weights, accept=accept,
                          feat_mean=tensor(f"{ARCH}.feat_mean").reshape(-1),
                          feat_std=tensor(f"{ARCH}.feat_std").reshape(-1))
