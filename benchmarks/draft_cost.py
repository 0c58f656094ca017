"""Cost of one SpecBlock block draft in llama.cpp vs one target token decode (issue 5, item 4).

    .venv/bin/python benchmarks/draft_cost.py [--target X.gguf] [--threads N] [--reps 30]

A random-weight SpecBlock at the target's width (K=4, 2 layers, ffn 1536, draft vocab 8192,
taps of 3 target layers; --block-size/--n-layer/--ffn-dim/--draft-vocab change them) is written as a drafter GGUF in f16 and q8_0 (converters/drafter.py).
After a 64-token context (real target taps), it times:
  target  one single-token llama_decode of the target at the end of that context;
  draft   one GgmlSpecBlockDrafter.block_outputs call: the K-row block batch through the drafter
          graph (conditioning, 2 layers over the cached context, head, rank head), reading the
          logits back and dropping the block rows from the drafter cache;
  observe one feature row into the drafter cache (what each committed token costs it);
  step    observe one row + one block, alternating as in the engine (each pass rebuilds its graph).
Medians over --reps runs; the issue asks for draft / target <= 0.25.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _median_ms(fn, reps: int) -> float:
    fn()  # warm (graph build / allocation)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="target GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BLOCKSPEC_THREADS", 0)) or 2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ffn-dim", type=int, default=1536, help="drafter FFN width (SpecBlock default 1536)")
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2, help="drafter layers (the shipped SpecBlock: 2)")
    ap.add_argument("--outtypes", default="f16,q8_0")
    args = ap.parse_args(argv)

    import torch

    from blockspec.converters.drafter import convert_drafter
    from blockspec.models import build_model
    from blockspec.runtime.drafters.ggml_backend import GgmlSpecBlockDrafter
    from blockspec.runtime.format.modelfile import bundled_model_path
    from blockspec.runtime.llama.prompt import prompt_tokens
    from blockspec.runtime.llama.target import Target, TargetConfig

    target_path = Path(args.target or bundled_model_path())
    res = dict(threads=args.threads, target=target_path.name, block_size=args.block_size,
               n_layer=args.n_layer, ffn_dim=args.ffn_dim, draft_vocab=args.draft_vocab)
    with Target(target_path, TargetConfig(n_ctx=512, n_threads=args.threads)) as t:
        layers = [1, t.n_layer // 2, t.n_layer - 1]
        text = "Explain in detail how a block drafter proposes several tokens in one pass. " * 4
        toks = prompt_tokens(t, text)[:64]
        n = len(toks)
        t.enable_taps(layers)
        t.decode(toks, range(n))
        feats = {lid: t.tap(lid).copy() for lid in layers}

        pos = [n]

        def target_step():
            t.decode([toks[-1]], [pos[0]])
            t.remove(0, pos[0], -1)

        res["target_ms"] = _median_ms(target_step, args.reps)

        torch.manual_seed(0)
        model = build_model(dict(model_type="specblock", dim=t.n_embd, target_dim=t.n_embd,
                                 n_head=t.n_embd // 64, n_kv_head=max(1, t.n_embd // 192), head_dim=64,
                                 ffn_dim=args.ffn_dim, n_layer=args.n_layer, block_size=args.block_size, vocab_size=t.n_vocab,
                                 draft_vocab_size=args.draft_vocab, target_layers=layers)).eval()
        with tempfile.TemporaryDirectory() as tmp:
            for ot in args.outtypes.split(","):
                path = convert_drafter(model, Path(tmp) / f"sb-{ot}.gguf", outtype=ot, target=str(target_path))
                d = GgmlSpecBlockDrafter(str(path), n_ctx=512, n_threads=args.threads)
                d.check_target(t)
                d.observe(toks[:-1], 0, {lid: f[:-1] for lid, f in feats.items()})
                draft_ms = _median_ms(lambda: d.block_outputs(toks), args.reps)

                def observe_one():
                    d.trim(n - 2)
                    d.observe(toks[n - 2:n - 1], n - 2, {lid: f[n - 2:n - 1] for lid, f in feats.items()})

                obs_ms = _median_ms(observe_one, args.reps)

                def step():  # what one engine step costs the drafter: a committed row, then a block
                    observe_one()
                    d.block_outputs(toks)

                step_ms = _median_ms(step, args.reps)
                d.close()
                res[ot] = dict(draft_ms=round(draft_ms, 3), observe_row_ms=round(obs_ms, 3),
                               step_ms=round(step_ms, 3), step_ratio=round(step_ms / res["target_ms"], 3),
                               ratio=round(draft_ms / res["target_ms"], 3),
                               size_mb=round(os.path.getsize(path) / 2**20, 1))
    res["target_ms"] = round(res["target_ms"], 3)
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
