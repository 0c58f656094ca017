"""BlockPilot: pick this request's block size from the target's first next-token distribution.

After prefill the target's last-token logits become the input (`feature_kind`):
- "softmax_summary": the top-k log-probs, the gaps between them and the entropy (as the SpecBlock
  rank head reads a softmax), 2 * top_k numbers;
- "raw": the softmax itself, all n_vocab probabilities (the paper's default input; its first layer
  is n_vocab x hidden, so at SmolLM2's 49152 tokens a hidden width of 2048 is ~100M parameters,
  ~400 MB in F32: pick a hidden width that fits the size you can ship).
The input is normalised with stored statistics and a small ReLU MLP scores the candidate block
sizes; the argmax is the block size used for the whole request. A second head on the same trunk
predicts c, the chance that a drafted token is accepted once the ones before it were (the prior of
`--block-size auto`, runtime/engine/policy.py). Labels come from an offline enumeration of the
runtime at each size (models/blockpilot_data.py). Paper: arXiv 2606.31315; code: AMAP-ML/BlockPilot
(there the MLP is Linear+ReLU, then residual Linear+ReLU layers, then a linear output over 5 sizes
B-2..B+2).

Block sizes count DRAFTED tokens per block, as the runtime's `--block-size` does. The candidates
are B-k .. B+k clipped to 1 .. max_block_size (the most the drafter can draft: a drafter trained on
blocks of 4 drafted tokens cannot draft 5), so B=2, k=2 on such a drafter gives {1, 2, 3, 4}.

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
FEATURE_KINDS = ("softmax_summary", "raw")


@dataclass
class ModelArgs:
    model_type: str = "blockpilot"
    feature_kind: str = "softmax_summary"  # or "raw" (the full softmax, n_vocab inputs)
    top_k: int = 8              # softmax summary: top_k log-probs + (top_k - 1) gaps + entropy
    n_vocab: int = 0            # the target's vocabulary (raw: the input width; 0: unknown, summary only)
    hidden_dim: int = 128
    n_layer: int = 2            # hidden layers: the first, then n_layer - 1 residual ones
    base_block_size: int = 2    # B, in drafted tokens
    spread: int = 2             # k: candidates B-k .. B+k, clipped to 1 .. max_block_size
    max_block_size: int = 0     # the drafter's trained block (drafted tokens); 0: no upper clip
    drafter_arch: str = ""      # specblock | dblast: the drafter the labels were measured with
    drafter_name: str = ""      # its file name (information only)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any]) -> "ModelArgs":
        return args_from_dict(cls, params)

    @property
    def n_features(self) -> int:
        return self.n_vocab if self.feature_kind == "raw" else 2 * self.top_k

    @property
    def block_sizes(self) -> list[int]:
        hi = self.base_block_size + self.spread
        if self.max_block_size:
            hi = min(hi, self.max_block_size)
        return list(range(max(1, self.base_block_size - self.spread), hi + 1))

    def __post_init__(self):
        if self.feature_kind not in FEATURE_KINDS:
            raise ValueError(f"feature_kind {self.feature_kind!r}: expected one of {', '.join(FEATURE_KINDS)}")
        if self.feature_kind == "raw" and self.n_vocab < 1:
            raise ValueError("a raw BlockPilot needs n_vocab (its input is the whole softmax)")
        if not self.block_sizes:
            raise ValueError(f"no block size in {self.base_block_size}±{self.spread} within "
                             f"1..{self.max_block_size or 'inf'} (block sizes count drafted tokens)")


def features(logits: torch.Tensor, top_k: int = 8, kind: str = "softmax_summary") -> torch.Tensor:
    """Last-token logits [..., V] -> BlockPilot input [..., F] (fp32): the summary (F = 2*top_k)
    or the raw softmax (F = V)."""
    if kind == "raw":
        return torch.softmax(logits.float(), dim=-1)
    return softmax_summary(logits, top_k)


class BlockPilot(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        dims = [args.n_features] + [args.hidden_dim] * args.n_layer
        # fc[0..n_layer-1] hidden (fc[i>0] residual), fc[n_layer] the output over block_sizes
        self.fc = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims[:-1], dims[1:]))
        self.fc.append(nn.Linear(args.hidden_dim, len(args.block_sizes)))
        self.accept = nn.Linear(args.hidden_dim, 1)  # logit of the per-token acceptance c
        # input normalisation, fitted on the training set (set_feature_stats)
        self.register_buffer("feat_mean", torch.zeros(args.n_features))
        self.register_buffer("feat_std", torch.ones(args.n_features))

    def set_feature_stats(self, feats: torch.Tensor) -> None:
        """Standardise each input from the training set; a raw input (probabilities, mostly ~0
        with a few large ones) is left as it is: per-token statistics over a few hundred prompts
        would blow rare tokens up by orders of magnitude."""
        if self.args.feature_kind == "raw":
            return
        self.feat_mean = feats.float().mean(0)
        self.feat_std = feats.float().std(0, correction=0).clamp_min(1e-3)

    def trunk(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., F] -> hidden [..., H]."""
        x = (feats.float() - self.feat_mean) / self.feat_std
        for i, fc in enumerate(self.fc[:-1]):
            y = F.relu(fc(x))
            x = y + x if i > 0 else y
        return x

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., F] -> scores [..., n_sizes]."""
        return self.fc[-1](self.trunk(feats))

    def heads(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats [..., F] -> (scores [..., n_sizes], acceptance logit [...])."""
        h = self.trunk(feats)
        return self.fc[-1](h), self.accept(h).squeeze(-1)

    def features(self, logits: torch.Tensor) -> torch.Tensor:
        return features(logits, self.args.top_k, self.args.feature_kind)

    @torch.no_grad()
    def choose(self, logits: torch.Tensor) -> int:
        """Block size for a request whose first next-token logits are `logits` [V]."""
        scores = self(self.features(logits))
        return self.args.block_sizes[int(scores.argmax(-1))]

    @torch.no_grad()
    def accept_rate(self, logits: torch.Tensor) -> float:
        return float(torch.sigmoid(self.heads(self.features(logits))[1]))


Model = BlockPilot


def n_params(model: BlockPilot) -> int:
    return sum(p.numel() for p in model.parameters()) + model.feat_mean.numel() + model.feat_std.numel()


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
