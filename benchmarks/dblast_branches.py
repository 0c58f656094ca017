"""DBlast's categories: what the prior's pick drafts against the best of its branches.

    python benchmarks/dblast_branches.py --drafter DBLAST.gguf --data EVAL_CACHE --target T.gguf [--batches 64]

On the blocks `train eval` scores (the evaluation set's greedy answers), every category z's greedy
branch is drafted from one pass. Per block: the accepted prefix of the prior's most likely branch (what
a chain serves), of each category's branch, and of the best branch (an oracle: what a tree of all
Kz branches would accept; the bound a better prior could reach in a chain). Prints the chain tau of
each, the first-token match rate of each, and how often the prior picks a best branch. One JSON object.
"""

from __future__ import annotations

import json

import click
import numpy as np


@click.command()
@click.option("--drafter", required=True, type=click.Path(exists=True), help="DBlast GGUF or checkpoint dir")
@click.option("--data", required=True, help="self-distilled cache (e.g. the evaluation set, `make eval-set`)")
@click.option("--target", required=True, type=click.Path(exists=True), help="the target GGUF")
@click.option("--batches", default=64, show_default=True, help="batches of 8 rows x 16 blocks")
def main(drafter: str, data: str, target: str, batches: int) -> None:
    import torch

    from blockspec.models.train import accepted_lengths, heldout_blocks

    model, blocks = heldout_blocks(drafter, data, target, batches)
    if model.args.model_type != "dblast":
        raise click.UsageError(f"--drafter {drafter}: a {model.args.model_type} drafter, not DBlast")
    Kz = model.args.n_categories
    acc_pick = acc_best = 0.0
    acc_z, first_z = np.zeros(Kz), np.zeros(Kz)
    first_pick = first_best = 0.0
    pick_is_best = n = 0
    with torch.no_grad():
        for b in blocks:
            out = model(b["feats"], b["anchors"], b["last"])
            draft = model.vocab.to_target(out.logits.argmax(-1))  # [B, N, Kz, P]
            lab, nxt, val = (b[k][:, :, None].expand_as(draft) for k in ("labels", "data_next", "valid"))
            a = accepted_lengths(draft, lab, nxt, val).float()  # [B, N, Kz]
            first = ((draft[..., 0] == lab[..., 0]) & val[..., 0]).float()  # [B, N, Kz]
            z = out.prior_logits.argmax(-1, keepdim=True)  # [B, N, 1]
            ok = b["valid"][..., 0]
            a_pick = a.gather(-1, z)[..., 0]
            best = a.max(-1).values
            acc_pick += float(a_pick[ok].sum())
            acc_best += float(best[ok].sum())
            acc_z += a[ok].sum(0).numpy()
            first_z += first[ok].sum(0).numpy()
            first_pick += float(first.gather(-1, z)[..., 0][ok].sum())
            first_best += float(first.max(-1).values[ok].sum())
            pick_is_best += int((a_pick == best)[ok].sum())
            n += int(ok.sum())
    r = lambda x: round(float(x), 4)  # noqa: E731
    print(json.dumps(dict(drafter=drafter, blocks=n, categories=Kz,
                          tau_prior_pick=r(1 + acc_pick / n), tau_best_branch=r(1 + acc_best / n),
                          tau_per_category=[r(1 + x / n) for x in acc_z],
                          first_prior_pick=r(first_pick / n), first_best_branch=r(first_best / n),
                          first_per_category=[r(x / n) for x in first_z], prior_picks_a_best=r(pick_is_best / n))))


if __name__ == "__main__":
    main()
