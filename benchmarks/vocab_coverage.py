"""Draft-vocabulary coverage: the share of the target's answer tokens a frequency-picked vocabulary holds.

    .venv/bin/python benchmarks/vocab_coverage.py --train DIR[,DIR..] --eval DIR [--drafter GGUF]
        [--sizes 4096,8192,16384]

Picks each size's vocabulary from the training caches' answer tokens (as `blockspec train` picks it:
the target's greedy tokens in its answers, most frequent first) and prints its coverage of those and of
the evaluation set's answers; with --drafter, also the coverage of that drafter's own vocabulary. Only
the token columns of the shards are read, never the features.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def answer_counts(dirs: list[str], vocab_size: int) -> np.ndarray:
    """Greedy-token counts over the answer positions of self-distilled caches (RaggedFeatures.label_counts)."""
    from safetensors import safe_open

    from blockspec.models.data import answer_positions

    counts = np.zeros(vocab_size, np.int64)
    for d in dirs:
        shards = sorted(Path(d).glob("shard_*.safetensors"))
        if not shards:
            raise SystemExit(f"{d}: no feature shards (a `blockspec train data` cache)")
        for p in shards:
            with safe_open(str(p), "numpy") as f:
                g, lengths, start = f.get_tensor("greedy"), f.get_tensor("lengths"), f.get_tensor("answer_start")
            counts += np.bincount(g[answer_positions(lengths, start)], minlength=vocab_size)
    return counts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", required=True, help="training caches, comma-separated")
    ap.add_argument("--eval", required=True, help="the evaluation-set cache (`make eval-set`)")
    ap.add_argument("--drafter", default="", help="a drafter GGUF whose own vocabulary to score too")
    ap.add_argument("--sizes", default="2048,4096,8192,16384", help="vocabulary sizes, comma-separated")
    a = ap.parse_args(argv)
    vocab = json.loads((Path(a.eval) / "meta.json").read_text())["vocab_size"]
    train, ev = answer_counts(a.train.split(","), vocab), answer_counts([a.eval], vocab)
    order = np.argsort(-train, kind="stable")
    cov = lambda c, ids: round(float(c[ids].sum() / max(1, c.sum())), 4)  # noqa: E731
    res = dict(train_tokens=int(train.sum()), eval_tokens=int(ev.sum()),
               sizes={n: dict(train=cov(train, order[:n]), eval=cov(ev, order[:n]))
                      for n in (int(s) for s in a.sizes.split(","))})
    if a.drafter:
        from gguf import GGUFReader

        d2t = [t for t in GGUFReader(a.drafter).tensors if t.name.endswith("d2t")]
        if not d2t:
            raise SystemExit(f"{a.drafter}: no d2t tensor (a drafter sharing the target's head)")
        ids = np.asarray(d2t[0].data).astype(np.int64)
        res["drafter"] = dict(size=len(ids), train=cov(train, ids), eval=cov(ev, ids))
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
