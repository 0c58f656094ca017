"""What a context copy adds to a block drafter: its teacher-forced tau with the lookup's continuation
given a bonus in the drafter's own log-probabilities.

    python benchmarks/copy_lookup.py --drafter D.gguf --data CACHE --target T.gguf [--batches 64]

For each block `train eval` scores (held-out greedy answers), the lookup finds the longest suffix of
the context (up to --max-ngram tokens) that occurred earlier, latest occurrence first, and proposes
the tokens that followed it. Position k of the chain drafts the lookup's k-th token instead of the
drafter's argmax where log q(copy) + bonus >= max log q and every earlier position drafted the copy
too. The bonus is chosen per match length (none, 1, 2, 3, >= 4 tokens). Two estimates of tau, because
neither is serving's: the mean over blocks of 1 + accepted (`train eval`'s; weights every position
alike, so long repeats count more than the passes they take) and 1 / the mean of 1 / (1 + accepted)
(passes per token; assumes acceptance is constant around each position, so it runs low). Prints both
for the drafter alone, the hard switch `specblock+ngram` serves (the lookup's block wherever >= 3
tokens match), the best bonus per match length, and the per-block oracle that knows which draft is longer.
"""

from __future__ import annotations

import json

import click
import numpy as np

BONUSES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 100.0)
BUCKETS = 4  # match lengths 1, 2, 3, >= 4


def lookup(h: np.ndarray, P: int, max_ngram: int) -> tuple[np.ndarray, int]:
    """The continuation (P tokens, -1 padded) of the longest earlier match of h's suffix, and its length."""
    ends = np.flatnonzero(h[:-1] == h[-1])  # earlier positions holding the last token
    m = 0
    best = -1
    for n in range(1, max_ngram + 1):
        if not len(ends):
            break
        best, m = int(ends[-1]), n
        if n == max_ngram:
            break
        ok = ends - n >= 0
        ends = ends[ok]
        ends = ends[h[ends - n] == h[len(h) - 1 - n]]
    cand = np.full(P, -1, np.int64)
    if best >= 0:
        c = h[best + 1:best + 1 + P]
        cand[:len(c)] = c
    return cand, m


@click.command()
@click.option("--drafter", required=True, type=click.Path(exists=True), help="drafter GGUF or checkpoint dir")
@click.option("--data", required=True, help="self-distilled cache(s), comma-separated")
@click.option("--target", required=True, type=click.Path(exists=True), help="the target GGUF")
@click.option("--batches", default=64, show_default=True, help="batches of 8 rows x 16 blocks")
@click.option("--max-ngram", default=8, show_default=True)
def main(drafter: str, data: str, target: str, batches: int, max_ngram: int) -> None:
    import torch

    from blockspec.models.train import accepted_lengths, heldout_blocks

    model, blocks = heldout_blocks(drafter, data, target, batches)
    P = model.args.n_predict
    acc = np.zeros((BUCKETS + 1, len(BONUSES)))  # bucket 0: no match
    inv = np.zeros((BUCKETS + 1, len(BONUSES)))  # sum of 1 / (1 + accepted): passes per token
    oracle, n_blocks = np.zeros(BUCKETS + 1), np.zeros(BUCKETS + 1)
    with torch.no_grad():
        for b in blocks:
            out = model(b["feats"], b["anchors"], b["last"])
            logp = torch.log_softmax(out.logits.float(), -1)  # [B, N, P, Vd]
            top, arg = logp.max(-1)
            own = model.vocab.to_target(arg)
            tok, anc = b["tokens"], b["anchors"].numpy()
            cand = np.full(anc.shape + (P,), -1, np.int64)
            mlen = np.zeros(anc.shape, np.int64)
            for r, n in np.ndindex(anc.shape):
                cand[r, n], mlen[r, n] = lookup(np.asarray(tok[r, :anc[r, n] + 2]), P, max_ngram)
            cand_t = torch.from_numpy(cand)
            cd = model.vocab.t2d(cand_t.clamp(min=0))
            usable = (cand_t >= 0) & (cd >= 0)
            lp_c = logp.gather(-1, cd.clamp(min=0)[..., None])[..., 0].masked_fill(~usable, -float("inf"))
            bucket = torch.from_numpy(np.minimum(mlen, BUCKETS))
            base = accepted_lengths(own, b["labels"], b["data_next"], b["valid"])
            copy_only = accepted_lengths(torch.where(cand_t >= 0, cand_t, -1), b["labels"], b["data_next"], b["valid"])
            for j, bonus in enumerate(BONUSES):
                take = (lp_c + bonus >= top).long()
                take = torch.cumprod(take, -1).bool()  # the copy while every earlier position took it
                draft = torch.where(take, cand_t, own)
                a = accepted_lengths(draft, b["labels"], b["data_next"], b["valid"])
                for k in range(BUCKETS + 1):
                    acc[k, j] += a[bucket == k].sum().item()
                    inv[k, j] += (1.0 / (1 + a[bucket == k].double())).sum().item()
            for k in range(BUCKETS + 1):
                sel = bucket == k
                n_blocks[k] += sel.sum().item()
                oracle[k] += torch.maximum(base, copy_only)[sel].sum().item()
    share = n_blocks / n_blocks.sum()
    per_block = 1 + acc / np.maximum(1, n_blocks)[:, None]  # [bucket, bonus]: mean tau of a block
    per_pass = inv / np.maximum(1, n_blocks)[:, None]  # mean passes per token
    hard = [0] * 3 + [len(BONUSES) - 1] * (BUCKETS - 2)  # specblock+ngram: the lookup's block from 3 matched tokens

    def rule(pick):  # tau by both estimates for one bonus index per bucket
        return dict(bonus=[BONUSES[j] for j in pick],
                    tau_per_block=round(float(sum(share[k] * per_block[k, j] for k, j in enumerate(pick))), 4),
                    tau_per_pass=round(float(1 / sum(share[k] * per_pass[k, j] for k, j in enumerate(pick))), 4))

    res = dict(drafter=drafter, blocks=int(n_blocks.sum()), bonuses=list(BONUSES),
               share_by_match=dict(zip(("none", "1", "2", "3", ">=4"), share.round(4).tolist())),
               drafter_alone=rule([0] * (BUCKETS + 1)), hard_switch=rule(hard),
               best_bonus_per_block=rule(per_block.argmax(1).tolist()),
               best_bonus_per_pass=rule(per_pass.argmin(1).tolist()),
               oracle_tau_per_block=round(float(1 + oracle.sum() / n_blocks.sum()), 4))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
