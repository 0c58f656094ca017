"""Where a drafter's serving passes fail, by how sure the target itself was.

    .venv/bin/python benchmarks/acceptance_by_confidence.py --drafter D [--drafter D2 ...]
        [--data ~/blockspec-train/eval-smollm2-bench] [--threads 1]

Replays greedy serving on the evaluation set's answers (`blockspec train eval --walk`: one block
drafted at each pass's anchor) and buckets every drafting pass by the target's own probability of
the token the pass's first drafted token must match (the top of the target's stored top-k at that
position, temperature 1). Per bucket: the share of passes, how often the first drafted token is
right, the mean accepted prefix, how often that token is outside the drafter's vocabulary, and what
a 3-token lookup would have drafted there (the token after the latest earlier occurrence of the last
three tokens, as `--method specblock+ngram` looks up): how often it has a proposal, how often that
proposal is right, and the share of the drafter's first-token misses it gets right. It tells misses
the target itself hesitates over (near-ties, which no small drafter is expected to resolve) from
misses on tokens the target is sure of, and how many of those the context already holds (copies).
Prints one JSON object per drafter (forty-second session: the shipped SpecBlock, benchmarks/HISTORY.md).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", action="append", required=True, help="checkpoint dir or drafter GGUF")
    ap.add_argument("--data", default=os.path.expanduser("~/blockspec-train/eval-smollm2-bench"))
    ap.add_argument("--model", default=None, help="target GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)

    import torch

    from blockspec.models import data as data_mod
    from blockspec.models.target import load_target
    from blockspec.models.train import Batches, accepted_lengths, draft_greedy, load_drafter, walk_row
    from blockspec.runtime.format.modelfile import bundled_model_path

    torch.set_num_threads(a.threads)
    target = load_target(a.model or bundled_model_path())
    out = []
    for path in a.drafter:
        model, _ = load_drafter(path, target)
        model.eval()
        source = data_mod.open_feature_cache(a.data, list(model.args.target_layers))
        batches = Batches(source, model.args.n_predict, 1.0, seed=0)
        p1s, firsts, ks, oovs, looks, labels = [], [], [], [], [], []
        with torch.no_grad():
            for r in batches.split["heldout"].tolist():
                anchors, _ = walk_row(model, batches, r)
                if not len(anchors):
                    continue
                b = batches.batch_at(np.array([r]), anchors[None], tokens=True)
                draft, _ = draft_greedy(model, b)
                p1s.append(b["top_logp"][0, :, 0, 0].exp().numpy())
                firsts.append((draft[0, :, 0] == b["labels"][0, :, 0]).numpy())
                labels.append(b["labels"][0, :, 0].numpy())
                ks.append(accepted_lengths(draft, b["labels"], b["data_next"], b["valid"])[0].numpy())
                oovs.append((model.vocab.t2d(b["labels"][0, :, 0]) < 0).numpy())
                looks.append(np.array([lookup(b["tokens"][0, :t + 2].tolist()) for t in anchors.tolist()]))
        p1, first, k, oov, look = (np.concatenate(x) for x in (p1s, firsts, ks, oovs, looks))
        label = np.concatenate([np.asarray(x) for x in labels])
        has, look_right = look >= 0, look == label
        buckets = []
        for lo, hi in zip(EDGES[:-1], EDGES[1:]):
            m = (p1 >= lo) & (p1 < hi)
            buckets.append(dict(target_p=f"{lo:.1f}-{min(hi, 1.0):.1f}", passes=round(float(m.mean()), 4),
                                first_right=round(float(first[m].mean()), 4) if m.any() else None,
                                accepted=round(float(k[m].mean()), 3) if m.any() else None,
                                outside_draft_vocab=round(float(oov[m].mean()), 4) if m.any() else None,
                                **lookup_figures(m, first, has, look_right),
                                share_of_first_misses=round(float((m & ~first).sum() / max(1, (~first).sum())), 4)))
        res = dict(drafter=path, passes=int(len(p1)), first_right=round(float(first.mean()), 4),
                   accepted=round(float(k.mean()), 4), outside_draft_vocab=round(float(oov.mean()), 4),
                   **lookup_figures(np.ones(len(p1), bool), first, has, look_right), buckets=buckets)
        print(json.dumps(res), flush=True)
        out.append(res)
    return out


def lookup(ctx: list[int], n: int = 3) -> int:
    """The token after the latest earlier occurrence of ctx's last n tokens (-1: none)."""
    key = ctx[-n:]
    for j in range(len(ctx) - n - 1, -1, -1):
        if ctx[j:j + n] == key:
            return ctx[j + n]
    return -1


def lookup_figures(m, first, has, look_right) -> dict:
    miss = m & ~first
    return dict(lookup_proposes=round(float(has[m].mean()), 4) if m.any() else None,
                lookup_right_where_it_proposes=round(float(look_right[m & has].mean()), 4) if (m & has).any() else None,
                drafter_right_there=round(float(first[m & has].mean()), 4) if (m & has).any() else None,
                misses_the_lookup_gets=round(float((miss & look_right).sum() / max(1, miss.sum())), 4))


if __name__ == "__main__":
    main()
