"""Where a drafter's first token misses: its match rate binned by how sure the target itself was.

    python benchmarks/first_token_confidence.py --drafter D.gguf --data EVAL_CACHE --target T.gguf [--batches 64]

On the held-out greedy answers of a self-distilled cache (the evaluation set: every prompt), the
blocks `train eval` scores, each drafted position binned by the target's own probability of its
greedy token there (exp of the cache's top-1 log-prob at T = 1). Per bin: the share of positions,
the drafter's match rate at block position 1 and at positions 1-4 (teacher-forced, as the estimate),
the share whose label lies outside the draft vocabulary, and the share whose (last token, label)
bigram already occurs in the context (what a lookup could copy) with the drafter's match rate
there. Prints one JSON object.
"""

from __future__ import annotations

import json
import click
import numpy as np

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


@click.command()
@click.option("--drafter", required=True, type=click.Path(exists=True), help="drafter GGUF or checkpoint dir")
@click.option("--data", required=True, help="self-distilled cache (e.g. the evaluation set, `make eval-set`)")
@click.option("--target", required=True, type=click.Path(exists=True), help="the target GGUF")
@click.option("--batches", default=64, show_default=True, help="batches of 8 rows x 16 blocks")
def main(drafter: str, data: str, target: str, batches: int) -> None:
    import torch

    from blockspec.models.train import draft_greedy, heldout_blocks

    model, blocks = heldout_blocks(drafter, data, target, batches)
    P = model.args.n_predict
    nb = len(EDGES) - 1
    count, hit, oov = (np.zeros((nb, P)) for _ in range(3))
    seen, seen_hit = np.zeros(nb), np.zeros(nb)
    with torch.no_grad():
        for b in blocks:
            draft, _ = draft_greedy(model, b)
            conf = b["top_logp"][..., 0].exp().numpy()  # [B, N, P]
            valid = b["valid"].numpy()
            match = (draft == b["labels"]).numpy()
            out = (model.vocab.t2d(b["labels"]) < 0).numpy()
            bins = np.digitize(conf, EDGES) - 1
            tok, anc, lab = b["tokens"], b["anchors"].numpy(), b["labels"].numpy()[..., 0]
            bigram = np.zeros(anc.shape, bool)
            for r, n in np.ndindex(anc.shape):
                ctx = tok[r, :anc[r, n] + 2]  # the context up to and including the block's last token
                bigram[r, n] = bool(((ctx[:-2] == ctx[-1]) & (ctx[1:-1] == lab[r, n])).any())
            for k in range(nb):
                sel = valid & (bins == k)
                count[k] += sel.sum((0, 1))
                hit[k] += (match & sel).sum((0, 1))
                oov[k] += (out & sel).sum((0, 1))
                s1 = sel[..., 0] & bigram
                seen[k] += s1.sum()
                seen_hit[k] += (match[..., 0] & s1).sum()
    total = count.sum(0)
    rows = [dict(target_p=f"{EDGES[k]:.1f}-{min(EDGES[k + 1], 1.0):.1f}",
                 share_pos1=round(count[k, 0] / max(1, total[0]), 4),
                 match_pos1=round(hit[k, 0] / max(1, count[k, 0]), 4),
                 match_all=round(hit[k].sum() / max(1, count[k].sum()), 4),
                 outside_vocab_pos1=round(oov[k, 0] / max(1, count[k, 0]), 4),
                 bigram_in_context_pos1=round(seen[k] / max(1, count[k, 0]), 4),
                 match_pos1_bigram_in_context=round(seen_hit[k] / max(1, seen[k]), 4)) for k in range(nb)]
    print(json.dumps(dict(drafter=drafter, positions_pos1=int(total[0]),
                          match_pos1=round(hit[:, 0].sum() / max(1, total[0]), 4), bins=rows), indent=1))


if __name__ == "__main__":
    main()
