"""What a drafter temperature would add at T > 0: the per-position acceptance of rejection sampling,
sum_x min(p(x), q(x)), with the drafter's law q sharpened to temperature t.

    python benchmarks/draft_temperature.py --drafter D.gguf --data EVAL_CACHE --target T.gguf [--batches 32]

On the held-out blocks `train eval` scores (teacher-forced on the target's greedy answers), the target's
law p is its cached top-8 under the request's default chain (top-p 0.95, min-p 0.05, temperature 1);
q is the drafter's top-40 under the same top-p / min-p and temperature t. Also the greedy draft's
acceptance p(argmax q) (`-match`). `p_support_hits_8`: the share of positions where p keeps all 8
cached candidates, i.e. where its tail may be cut (the figures are then lower bounds). Prints one
JSON object: acceptance per block position for each t.
"""

from __future__ import annotations

import json

import click
import numpy as np

TEMPS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2)
TOP_P, MIN_P = 0.95, 0.05


def chain(lp: np.ndarray, temp: float) -> np.ndarray:
    """Log-probs [..., n] sorted best first -> probabilities after top-p, min-p and temperature."""
    rel = lp - lp[..., :1]
    p = np.exp(rel)
    p = p / p.sum(-1, keepdims=True)
    keep = np.concatenate([np.ones_like(p[..., :1], bool), np.cumsum(p, -1)[..., :-1] < TOP_P], -1)
    keep &= np.exp(rel) >= MIN_P
    e = np.exp(np.where(keep, rel / temp, -np.inf))
    return e / e.sum(-1, keepdims=True)


@click.command()
@click.option("--drafter", required=True, type=click.Path(exists=True), help="drafter GGUF or checkpoint dir")
@click.option("--data", required=True, help="self-distilled cache (e.g. the evaluation set, `make eval-set`)")
@click.option("--target", required=True, type=click.Path(exists=True), help="the target GGUF")
@click.option("--batches", default=32, show_default=True, help="batches of 8 rows x 16 blocks")
def main(drafter: str, data: str, target: str, batches: int) -> None:
    import torch

    from blockspec.models.train import heldout_blocks

    model, blocks = heldout_blocks(drafter, data, target, batches)
    d2t = model.vocab.d2t.numpy()
    P = model.args.n_predict
    keys = [*map(str, TEMPS), "match"]
    acc, n, cut = {k: np.zeros(P) for k in keys}, np.zeros(P), 0
    with torch.no_grad():
        for b in blocks:
            top = torch.log_softmax(model(b["feats"], b["anchors"], b["last"]).logits.float(), -1).topk(40, -1)
            qlp, qid = top.values.numpy(), d2t[top.indices.numpy()]
            tid, valid = b["top_ids"].numpy(), b["valid"].numpy()
            p = chain(b["top_logp"].numpy(), 1.0)
            cut += int((p[..., -1] > 0)[valid].sum())
            same = tid[..., :, None] == qid[..., None, :]  # [..., 8, 40]
            for t in TEMPS:
                a = np.minimum(p, (same * chain(qlp, t)[..., None, :]).sum(-1)).sum(-1)
                acc[str(t)] += (a * valid).sum((0, 1))
            acc["match"] += (((tid == qid[..., :1]) * p).sum(-1) * valid).sum((0, 1))
            n += valid.sum((0, 1))
    print(json.dumps(dict(drafter=drafter, positions=int(n[0]), p_support_hits_8=round(cut / max(1, n.sum()), 4),
                          acceptance={k: [round(float(x), 4) for x in v / np.maximum(n, 1)] for k, v in acc.items()}),
                     indent=1))


if __name__ == "__main__":
    main()
