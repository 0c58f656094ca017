"""One of our generations in a process of its own, for bench rows that need another kernel mode.

patch 0004 reads GGML_BATCH_INVARIANT once per process, so `plain-upstream-kernels` (our engine's
plain decoding on upstream's default CPU kernels) cannot share the bench's target: the bench starts

    python -m blockspec.runtime.bench.worker  < {"model", "tokens", "max_tokens", "sampling", "n_ctx", "threads"}

with the variable set, and reads one JSON line back: the generated tokens and the engine's stats.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    spec = json.loads(sys.stdin.read())
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.llama.target import open_target

    with open_target(spec["model"], n_ctx=spec["n_ctx"], n_threads=spec["threads"]) as target:
        g = generate(target, spec["tokens"], max_tokens=spec["max_tokens"],
                     sampling=SamplingParams(**spec["sampling"]))
    out = g.to_json()
    del out["text"]
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
