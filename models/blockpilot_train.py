"""Train BlockPilot on a label dir (models/blockpilot_data.py) and report how it serves.

    blockspec train blockpilot --labels DIR --out CKPT [--feature-kind softmax_summary|raw] [--label measured]

Cross-entropy on the best-b label (measured tokens/s by default, the issue's definition; or the
modelled one, see blockpilot_data) plus a binary cross-entropy on the acceptance head against the
measured per-token acceptance c. Full-batch AdamW: a label set is a few hundred prompts. A fixed
share of the prompts (by prompt index, seeded) is held out; the report on it:
- accuracy of the chosen b against the label, and the majority-class baseline's;
- for tok_s (measured), modelled tokens/s and tau: the mean at the pilot's choice, at the per-prompt
  oracle (best b by that metric), at each fixed b and at plain decoding; regret = oracle - pilot;
- the acceptance head's mean absolute error, and the train-mean constant's.
The checkpoint (models/blockpilot.save_checkpoint) carries model_args, this config and the report,
so `blockspec convert blockpilot CKPT OUT.gguf` rebuilds the model from the files alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from blockspec.runtime.errors import BlockspecError

MAX_GGUF_BYTES = 20_000_000  # the size budget of a shipped pilot (raw inputs make the first layer big)


@dataclass
class PilotTrainConfig:
    labels: str = ""
    out: str = ""
    feature_kind: str = "softmax_summary"   # or raw
    label: str = "measured"                 # or modelled
    top_k: int = 8
    hidden_dim: int = 0                     # 0: 128 for the summary; raw: the widest that fits MAX_GGUF_BYTES
    n_layer: int = 2
    epochs: int = 400
    lr: float = 3e-3
    weight_decay: float = 1e-2
    accept_weight: float = 1.0
    heldout_frac: float = 0.2
    seed: int = 0
    threads: int = 1


def raw_hidden_for_budget(n_vocab: int, n_layer: int, n_sizes: int, budget: int = MAX_GGUF_BYTES) -> int:
    """The widest hidden layer (a multiple of 8) whose F32 raw-input pilot stays under `budget` bytes."""
    h = 8
    while True:
        nxt = h + 8
        params = n_vocab * nxt + nxt + (n_layer - 1) * (nxt * nxt + nxt) + (nxt + 1) * (n_sizes + 1) + 2 * n_vocab
        if 4 * params + 4096 > budget:
            return h
        h = nxt


def split_by_prompt(prompt_idx: np.ndarray, frac: float, seed: int) -> np.ndarray:
    """Boolean held-out mask [n]: a seeded `frac` of the distinct prompts (at least one when there
    are two or more)."""
    ids = np.unique(prompt_idx)
    rng = np.random.default_rng(seed)
    n_held = int(round(frac * len(ids)))
    if len(ids) >= 2:
        n_held = min(max(n_held, 1), len(ids) - 1)
    held = set(rng.permutation(ids)[:n_held].tolist())
    return np.array([int(i) in held for i in prompt_idx])


def serving_report(choice: np.ndarray, lab: dict, rows: np.ndarray, labels: np.ndarray, costs) -> dict:
    """What choosing candidate index `choice` [m] on `rows` would serve, against the oracle and
    every fixed b (pure: label arrays in, numbers out)."""
    from .blockpilot_data import modelled_rate

    sizes = lab["meta"]["block_sizes"]
    metrics = dict(tok_s=lab["tok_s"][rows], modelled_tok_s=modelled_rate(lab, costs)[rows], tau=lab["tau"][rows])
    rep = dict(n=int(rows.sum()), accuracy=round(float((choice == labels).mean()), 3) if len(labels) else None,
               chosen={str(b): int((choice == j).sum()) for j, b in enumerate(sizes)})
    idx = np.arange(len(choice))
    for name, m in metrics.items():
        cand = m[:, 1:]
        pilot = float(cand[idx, choice].mean())
        oracle = float(cand.max(1).mean())
        rep[name] = dict(pilot=round(pilot, 3), oracle=round(oracle, 3), regret=round(oracle - pilot, 3),
                         plain=round(float(m[:, 0].mean()), 3),
                         fixed={str(b): round(float(cand[:, j].mean()), 3) for j, b in enumerate(sizes)},
                         pilot_minus_fixed={str(b): round(pilot - float(cand[:, j].mean()), 3)
                                            for j, b in enumerate(sizes)})
    return rep


def train_blockpilot(cfg: PilotTrainConfig, log=print) -> dict:
    """Train, evaluate on the held-out prompts, save the checkpoint; returns the report."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from . import blockpilot as bp
    from .blockpilot_data import LABEL_KINDS, best_b, load_labels, pooled_acceptance, step_costs

    if cfg.feature_kind not in bp.FEATURE_KINDS:
        raise BlockspecError(f"--feature-kind {cfg.feature_kind!r}: expected one of {', '.join(bp.FEATURE_KINDS)}")
    if cfg.label not in LABEL_KINDS:
        raise BlockspecError(f"--label {cfg.label!r}: expected one of {', '.join(LABEL_KINDS)}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    lab = load_labels(cfg.labels)
    meta = lab["meta"]
    sizes = list(meta["block_sizes"])
    if sizes != list(range(sizes[0], sizes[-1] + 1)):
        raise BlockspecError(f"{cfg.labels}: block sizes {sizes} are not a contiguous range B-k..B+k")
    n = len(lab["prompt_idx"])
    held = split_by_prompt(lab["prompt_idx"], cfg.heldout_frac, cfg.seed)
    train = ~held
    if train.sum() < 1:
        raise BlockspecError(f"{cfg.labels}: {n} labelled prompts leave none to train on")
    # the cost model of the modelled label comes from the training prompts only
    costs = step_costs({k: v[train] for k, v in lab.items() if k != "meta"})
    labels = best_b(lab, cfg.label, costs)
    accept = pooled_acceptance(lab["hist"], sizes)

    k = (sizes[-1] - sizes[0] + 1) // 2  # B-k..B+k clipped to 1..trained block covers exactly `sizes`
    base = sizes[0] + k
    hidden = cfg.hidden_dim or (128 if cfg.feature_kind == "softmax_summary" else
                                raw_hidden_for_budget(int(meta["n_vocab"]), cfg.n_layer, len(sizes)))
    args = bp.ModelArgs(feature_kind=cfg.feature_kind, top_k=cfg.top_k, n_vocab=int(meta["n_vocab"]),
                        hidden_dim=hidden, n_layer=cfg.n_layer, base_block_size=base, spread=k,
                        max_block_size=sizes[-1], drafter_arch=meta["drafter_arch"],
                        drafter_name=meta["drafter_name"])
    if args.block_sizes != sizes:  # e.g. labels for 2..3 only: B=3, k=1 would give 2..4
        args = dataclasses.replace(args, base_block_size=sizes[0] + (sizes[-1] - sizes[0]) // 2,
                                   spread=(sizes[-1] - sizes[0]) // 2, max_block_size=sizes[-1])
        if args.block_sizes != sizes:
            raise BlockspecError(f"block sizes {sizes} are not of the form B-k..B+k within 1..{sizes[-1]}")
    model = bp.BlockPilot(args)
    logits = torch.from_numpy(lab["logits"].astype(np.float32))
    feats = model.features(logits)  # [n, F]
    model.set_feature_stats(feats[torch.from_numpy(train)])
    y = torch.from_numpy(labels).long()
    c = torch.from_numpy(accept).float()
    tr = torch.from_numpy(train)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    bar = tqdm(range(cfg.epochs), desc=f"blockpilot ({cfg.feature_kind})", unit="epoch", mininterval=2.0)
    for _ in bar:
        model.train()
        scores, a_logit = model.heads(feats[tr])
        loss_b = F.cross_entropy(scores, y[tr])
        loss_c = F.binary_cross_entropy_with_logits(a_logit, c[tr])
        loss = loss_b + cfg.accept_weight * loss_c
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix_str(f"ce {loss_b.item():.3f} acc-bce {loss_c.item():.3f}")
    bar.close()
    model.eval()
    with torch.no_grad():
        scores, a_logit = model.heads(feats)
    choice = scores.argmax(-1).numpy()
    c_pred = torch.sigmoid(a_logit).numpy()
    majority = int(np.bincount(labels[train], minlength=len(sizes)).argmax())
    report = dict(labels=cfg.labels, label=cfg.label, feature_kind=cfg.feature_kind, block_sizes=sizes,
                  n_params=bp.n_params(model), gguf_mib_estimate=round(4 * bp.n_params(model) / 2 ** 20, 2),
                  n_train=int(train.sum()), n_heldout=int(held.sum()),
                  label_counts_train={str(b): int((labels[train] == j).sum()) for j, b in enumerate(sizes)},
                  majority_b=sizes[majority],
                  train=dict(accuracy=round(float((choice[train] == labels[train]).mean()), 3)))
    if held.any():
        report["heldout"] = serving_report(choice[held], lab, held, labels[held], costs)
        report["heldout"]["majority_accuracy"] = round(float((labels[held] == majority).mean()), 3)
        report["heldout"]["accept_mae"] = round(float(np.abs(c_pred[held] - accept[held]).mean()), 4)
        report["heldout"]["accept_mae_constant"] = round(float(np.abs(accept[train].mean() - accept[held]).mean()), 4)
        # the other label kind's accuracy, for the report (the model was trained on cfg.label)
        other = [kd for kd in LABEL_KINDS if kd != cfg.label][0]
        report["heldout"][f"accuracy_vs_{other}_label"] = round(float(
            (choice[held] == best_b(lab, other, costs)[held]).mean()), 3)
    bp.save_checkpoint(cfg.out, model, train_config=dataclasses.asdict(cfg), report=report)
    return report
