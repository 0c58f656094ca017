"""BlockPilot: pick this request's block size from the target's first next-token distribution.

After prefill the target's last-token logits are summarised (`features`: the top-k log-probs,
the gaps between them and the entropy, as the SpecBlock rank head reads a softmax), normalised
with stored statistics, and a small ReLU MLP scores the candidate block sizes B-k .. B+k; the
argmax is the block size used for the whole request. Labels come from an offline enumeration of
the acceptance length at each size. Paper: arXiv 2606.31315; code: AMAP-ML/BlockPilot (there the
MLP is Linear+ReLU, then residual Linear+ReLU layers, then a linear output over 5 sizes B-2..B+2).

Checkpoint: `blockpilot.safetensors` + `blockpilot.json` {model_args, ...} in one directory, like a
drafter checkpoint (models/train.py), so `blockspec convert blockpilot` rebuilds it from the files
alone. The runtime reads the converted GGUF with numpy (converters/blockpilot.py), not torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .common import args_from_dict
from .drafter import softmax_summary

WEIGHTS, META = "blockpilot.safetensors", "blockpilot.json"


@dataclass
class ModelArgs:
    model_type: str = "blockpilot"
    top_k: int = 8              # softmax summary: top_k log-probs + (top_k - 1) gaps + entropy
    hidden_dim: int = 128
    n_layer: int = 2            # hidden layers: the first, then n_layer - 1 residual ones
    base_block_size: int = 16   # B
    spread: int = 2             # k: candidates B-k .. B+k

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        return args_from_dict(cls, params)

    @property
    def n_features(self) -> int:
        return 2 * self.top_k

    @property
    def block_sizes(self) -> list[int]:
        return list(range(self.base_block_size - self.spread, self.base_block_size + self.spread + 1))

    def __post_init__(self):
        if self.base_block_size - self.spread < 2:
            raise ValueError(f"block sizes {self.block_sizes} must all be >= 2 (a block drafts at least 1 token)")


def features(logits: torch.Tensor, top_k: int = 8) -> torch.Tensor:
    """Last-token logits [..., V] -> BlockPilot features [..., 2*top_k] (fp32)."""
    return softmax_summary(logits, top_k)


class BlockPilot(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        dims = [args.n_features] + [args.hidden_dim] * args.n_layer
        # fc[0..n_layer-1] hidden (fc[i>0] residual), fc[n_layer] the output over block_sizes
        self.fc = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:]))
        self.fc.append(nn.Linear(args.hidden_dim, len(args.block_sizes)))
        # feature normalisation, fitted on the training set (set_feature_stats)
        self.register_buffer("feat_mean", torch.zeros(args.n_features))
        self.register_buffer("feat_std", torch.ones(args.n_features))

    def set_feature_stats(self, feats: torch.Tensor) -> None:
        self.feat_mean = feats.float().mean(0)
        self.feat_std = feats.float().std(0).clamp_min(1e-3)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., F] -> scores [..., n_sizes]."""
        x = (feats.float() - self.feat_mean) / self.feat_std
        for i, fc in enumerate(self.fc[:-1]):
            y = F.relu(fc(x))
            x = y + x if i > 0 else y
        return self.fc[-1](x)

    @torch.no_grad()
    def choose(self, logits: torch.Tensor) -> int:
        """Block size for a request whose first next-token logits are `logits` [V]."""
        scores = self(features(logits, self.args.top_k))
        return self.args.block_sizes[int(scores.argmax(-1))]


Model = BlockPilot


def save_checkpoint(out: str | os.PathLike, model: BlockPilot, **meta) -> Path:
    """Write `blockpilot.safetensors` + `blockpilot.json` {model_args, **meta} into dir `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / (WEIGHTS + ".tmp")))
    os.replace(out / (WEIGHTS + ".tmp"), out / WEIGHTS)
    (out / (META + ".tmp")).write_text(json.dumps(dict(model_args=dataclasses.asdict(model.args), **meta), indent=1))
    os.replace(out / (META + ".tmp"), out / META)
    return out


def load_checkpoint(ckpt_dir: str | os.PathLike) -> tuple[BlockPilot, dict]:
    from safetensors.torch import load_file

    d = Path(ckpt_dir)
    meta = json.loads((d / META).read_text())
    model = BlockPilot(ModelArgs.from_dict(meta["model_args"]))
    model.load_state_dict(load_file(str(d / WEIGHTS)))
    return model.eval(), meta
