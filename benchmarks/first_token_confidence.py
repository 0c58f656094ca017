"""Where a drafter's first token misses: its match rate binned by how sure the target itself was.

    python benchmarks/first_token_confidence.py --drafter D.gguf --data EVAL_CACHE --target T.gguf [--batches 64] [--walk]

On the held-out greedy answers of a self-distilled cache (the evaluation set: every prompt), the
blocks `train eval` scores, each drafted position binned by the target's own probability of its
greedy token there (exp of the cache's top-1 log-prob at T = 1). Per bin: the share of positions,
the drafter's match rate at block position 1 and at positions 1-4 (teacher-forced, as the estimate),
the share whose label lies outside the draft vocabulary, and the share whose (last token, label)
bigram already occurs in the context (what a lookup could copy) with the drafter's match rate
there; and what the runtime's 3-token lookup (`--method specblock+ngram`'s, runtime/drafters/ngram.py)
would draft first there: how often it proposes, how often that is right, the drafter's match rate where
it proposes, and the share of the drafter's first-token misses it gets right. --walk: the blocks greedy
serving drafts (one per target pass, `train eval --walk`) instead of blocks anchored uniformly. Prints
one JSON object.
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
@click.option("--walk", is_flag=True, help="the blocks greedy serving drafts, every held-out answer (--batches unused)")
def main(drafter: str, data: str, target: str, batches: int, walk: bool) -> None:
    import torch

    from blockspec.models.train import draft_greedy, heldout_blocks
    from blockspec.runtime.drafters.ngram import NgramDrafter

    model, blocks = heldout_blocks(drafter, data, target, batches, walk=walk)
    lookup = NgramDrafter(block_size=1)
    P = model.args.n_predict
    nb = len(EDGES) - 1
    count, hit, oov = (np.zeros((nb, P)) for _ in range(3))
    seen, seen_hit = np.zeros(nb), np.zeros(nb)
    proposes, look_hit, look_draft_hit, miss, miss_look_hit = (np.zeros(nb) for _ in range(5))
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
            look = np.full(anc.shape, -1)
            for r, n in np.ndindex(anc.shape):
                ctx = tok[r, :anc[r, n] + 2]  # the context up to and including the block's last token
                bigram[r, n] = bool(((ctx[:-2] == ctx[-1]) & (ctx[1:-1] == lab[r, n])).any())
                proposal = lookup.propose(ctx).tokens
                look[r, n] = proposal[1] if len(proposal) > 1 else -1
            for k in range(nb):
                sel = valid & (bins == k)
                count[k] += sel.sum((0, 1))
                hit[k] += (match & sel).sum((0, 1))
                oov[k] += (out & sel).sum((0, 1))
                s1 = sel[..., 0] & bigram
                seen[k] += s1.sum()
                seen_hit[k] += (match[..., 0] & s1).sum()
                s0, lp = sel[..., 0], look >= 0
                proposes[k] += (s0 & lp).sum()
                look_hit[k] += (s0 & (look == lab)).sum()
                look_draft_hit[k] += (s0 & lp & match[..., 0]).sum()
                miss[k] += (s0 & ~match[..., 0]).sum()
                miss_look_hit[k] += (s0 & ~match[..., 0] & (look == lab)).sum()
    total = count.sum(0)
    rows = [dict(target_p=f"{EDGES[k]:.1f}-{min(EDGES[k + 1], 1.0):.1f}",
                 share_pos1=round(count[k, 0] / max(1, total[0]), 4),
                 match_pos1=round(hit[k, 0] / max(1, count[k, 0]), 4),
                 match_all=round(hit[k].sum() / max(1, count[k].sum()), 4),
                 outside_vocab_pos1=round(oov[k, 0] / max(1, count[k, 0]), 4),
                 bigram_in_context_pos1=round(seen[k] / max(1, count[k, 0]), 4),
                 match_pos1_bigram_in_context=round(seen_hit[k] / max(1, seen[k]), 4),
                 **lookup_figures(count[k, 0], proposes[k], look_hit[k], look_draft_hit[k], miss[k], miss_look_hit[k]))
            for k in range(nb)]
    print(json.dumps(dict(drafter=drafter, walk=walk, positions_pos1=int(total[0]),
                          match_pos1=round(hit[:, 0].sum() / max(1, total[0]), 4),
                          outside_vocab_pos1=round(oov[:, 0].sum() / max(1, total[0]), 4),
                          **lookup_figures(total[0], proposes.sum(), look_hit.sum(), look_draft_hit.sum(), miss.sum(),
                                           miss_look_hit.sum()), bins=rows), indent=1))


def lookup_figures(n, proposes, look_hit, look_draft_hit, miss, miss_look_hit) -> dict:
    """The lookup's columns of a bin (or of all positions) from its counts at block position 1."""
    return dict(lookup_proposes_pos1=round(proposes / max(1, n), 4),
                lookup_right_where_it_proposes=round(look_hit / max(1, proposes), 4),
                match_pos1_where_lookup_proposes=round(look_draft_hit / max(1, proposes), 4),
                misses_the_lookup_gets=round(miss_look_hit / max(1, miss), 4))


if __name__ == "__main__":
    main()
