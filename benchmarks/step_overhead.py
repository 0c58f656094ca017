"""Where a speculative step's time goes (issue 14, item 2): target decode, drafter, and the rest.

    .venv/bin/python benchmarks/step_overhead.py [--methods plain,ngram,specblock,ngram-auto] [--threads N]
        [--max-tokens 128] [--temperature 0] [--prompts 4]

Generates with each method on the same prompts (the bench's: the first --prompts of each of MT-Bench
and HumanEval, rendered with the GGUF's chat template) and splits the generation's wall time into
  decode    time inside Target.decode (llama_decode: the target's passes, prefill excluded),
  drafter   Stats.draft_s (proposals and the drafter's pass over committed rows),
  overhead  everything else: batch building, logits copies, acceptance, sampling, cache
            operations (seq_cp / seq_rm / pack_tail), bookkeeping, stats, detokenisation.
Overhead is reported per step in ms and as a share of one plain token (plain's wall time per
token in the same run), the figure the issue bounds at 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="plain,ngram,specblock")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BLOCKSPEC_THREADS", 0)) or 2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--prompts", type=int, default=2, help="prompts of each of MT-Bench and HumanEval")
    args = ap.parse_args(argv)

    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.engine.setup import NO_PILOT, make_drafter, open_target_for
    from blockspec.runtime.format.modelfile import bundled_model_path
    from blockspec.runtime.bench.run import METHODS, load_prompts, method
    from blockspec.runtime.llama.prompt import chat_tokens

    methods = args.methods.split(",")
    # method names as the bench reads them (ngram-auto: --block-size auto, as its rows)
    unknown = [m for m in methods if m.partition("@")[0] not in METHODS]
    if unknown:
        ap.error(f"unknown method {', '.join(unknown)}; the bench's: {', '.join(METHODS)}")
    specs = {m: method(m) for m in methods}
    drafters = {m: make_drafter(s.base, block_size="auto" if s.auto else 4, branches=s.branches, blockpilot=NO_PILOT)
                for m, s in specs.items()}
    sampling = SamplingParams(temperature=args.temperature, seed=0)
    res: dict = dict(threads=args.threads, max_tokens=args.max_tokens, temperature=args.temperature)
    with open_target_for(bundled_model_path(), [d for d in drafters.values() if d is not None],
                         n_threads=args.threads) as t:
        if any(d is not None for d in drafters.values()):
            t.exact_batch_limit  # the one-time probe (its decodes are not generation time)
        decode, prefill = t.decode, t.prefill
        spent = [0.0]
        in_prefill = [False]

        def timed_decode(*a, **k):
            t0 = time.perf_counter()
            try:
                return decode(*a, **k)
            finally:
                if not in_prefill[0]:
                    spent[0] += time.perf_counter() - t0

        def untimed_prefill(*a, **k):  # prompt passes are not generation time
            in_prefill[0] = True
            try:
                return prefill(*a, **k)
            finally:
                in_prefill[0] = False

        t.decode, t.prefill = timed_decode, untimed_prefill
        prompts = [chat_tokens(t, msgs) for msgs in load_prompts("mtbench,humaneval", args.prompts)]
        for m in methods:
            wall = dec = draft = 0.0
            steps = toks = 0
            for p in prompts:
                spent[0] = 0.0
                g = generate(t, p, max_tokens=args.max_tokens, sampling=sampling, drafter=drafters[m])
                gen_s = g.n_tokens / g.stats.tokens_per_s
                wall += gen_s
                dec += spent[0]
                draft += g.stats.draft_s
                steps += g.stats.target_passes - 1
                toks += g.n_tokens
            over = wall - dec - draft
            res[m] = dict(tokens=toks, steps=steps, tau=round(toks / max(steps, 1), 3),
                          ms_per_token=round(1e3 * wall / toks, 3), decode_share=round(dec / wall, 3),
                          drafter_share=round(draft / wall, 3), overhead_ms_per_step=round(1e3 * over / max(steps, 1), 3))
    plain_ms = res.get("plain", {}).get("ms_per_token")
    if plain_ms:
        for m in methods:
            res[m]["overhead_per_plain_token"] = round(res[m]["overhead_ms_per_step"] / plain_ms, 3)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
