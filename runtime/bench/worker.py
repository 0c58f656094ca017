"""One of our generations in a process of its own, for bench rows that need another kernel mode.

patch 0004 reads GGML_BATCH_INVARIANT once per process, so `plain-upstream-kernels` (our engine's
plain decoding on upstream's default CPU kernels) cannot share the bench's target: the bench starts

    python -m blockspec.runtime.bench.worker  < {"model", "tokens", "max_tokens", "sampling", "n_ctx", "threads",
                                                "method": "plain" | "ngram", "block_size"}

with the variable set, and reads one JSON line back: the generated tokens and the engine's stats.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(sys.stdin.read())
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.engine.setup import make_drafter, open_target_for

    method = spec.get("method", "plain")
    drafter = make_drafter(method, block_size=spec.get("block_size") or 4) if method != "plain" else None
    with open_target_for(spec["model"], [drafter], n_ctx=spec["n_ctx"], n_threads=spec["threads"]) as target:
        # a fresh process meets every batch shape for the first time (graph allocation, page faults),
        # which the bench's own rows paid on their first prompt only: warm the shapes up untimed
        generate(target, spec["tokens"], max_tokens=min(16, spec["max_tokens"]),
                 sampling=SamplingParams(**{**spec["sampling"], "temperature": 0.0}), drafter=drafter)
        target.clear()  # the timed run prefills from scratch, as without the warm-up (no reused prefix)
        g = generate(target, spec["tokens"], max_tokens=spec["max_tokens"],
                     sampling=SamplingParams(**spec["sampling"]), drafter=drafter)
    out = g.to_json()
    del out["text"]
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
