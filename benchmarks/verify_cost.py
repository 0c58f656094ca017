"""The verify-cost curve: a target pass over n rows relative to one row, as the engine runs it.

    .venv/bin/python benchmarks/verify_cost.py [--model GGUF|name] [--threads N] [--reps 20] [--ctx 128]

After a --ctx-token context, times one llama_decode of n rows (n = 1..8, 12, 16) at the end of it
and removes the rows again (what a rejected draft costs), in the runtime's own settings (flash
attention, batch-invariant CPU kernels, the same threads). Prints the median seconds per n and
the ratio to n = 1: with block drafts of depth k costing verify(k + 1) + draft, a drafter must
accept more than verify(k + 1) / verify(1) - 1 + draft tokens per step to beat plain decoding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path or fetched model name (default: bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--sizes", default="1,2,3,4,5,6,8,12,16", help="row counts (1 first: the ratios' base)")
    a = ap.parse_args(argv)

    from blockspec.runtime.llama.target import open_target

    sizes = [int(n) for n in a.sizes.split(",")]
    with open_target(a.model, n_ctx=1024, n_seq_max=1, n_threads=a.threads) as t:
        ctx = [t.bos if t.bos is not None and t.bos >= 0 else 1] + [(17 * i) % 1000 + 100 for i in range(a.ctx - 1)]
        t.clear()
        t.decode(ctx, range(len(ctx)), logits=[False] * len(ctx))
        out = {}
        for n in sizes:
            rows = [(31 * i) % 1000 + 100 for i in range(n)]
            times = []
            for r in range(a.reps + 1):
                t0 = time.perf_counter()
                t.decode(rows, range(len(ctx), len(ctx) + n), logits=[True] * n)
                dt = time.perf_counter() - t0
                t.remove(-1, len(ctx), -1)
                if r:  # the first run builds the graph for this size
                    times.append(dt)
            out[n] = statistics.median(times)
        base = out[1]
        res = {"model": str(t.path), "threads": t.n_threads, "context": len(ctx),
               "seconds": {n: round(s, 5) for n, s in out.items()},
               "ratio": {n: round(s / base, 2) for n, s in out.items()}}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
