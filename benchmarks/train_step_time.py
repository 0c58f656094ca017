"""Seconds per training step of a drafter, fp32 against `--precision bf16`, at a recipe's shape.

    .venv/bin/python benchmarks/train_step_time.py [--threads 1] [--rows 8] [--anchors 64] [--seq 600] [--reps 6]

Builds a SpecBlock (distillation on) and a DBlast (4 categories, --loss al) the size `blockspec train`
makes for the bundled SmolLM2 (4,096 draft tokens), and times forward, loss, backward and the AdamW
step on one random batch of `rows` sequences of `seq` tokens with `anchors` blocks each (the stage
recipes: 8 x 64, answers of ~600 tokens with their prompts), in fp32 and under bf16 autocast as
`train --precision bf16` runs it. Prints the median of the last reps-2 steps per method and mode. Run
it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=64)
    ap.add_argument("--seq", type=int, default=600)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args(argv)

    import torch

    from blockspec.models import build_model
    from blockspec.models.target import load_target
    from blockspec.models.train import TrainConfig, loss_terms, make_model_args
    from blockspec.runtime.format.modelfile import bundled_model_path

    torch.set_num_threads(a.threads)
    target = load_target(a.model or bundled_model_path())
    out = {}
    for method, extra in (("specblock", dict(distill_weight=0.5)), ("dblast", dict(n_categories=4, loss="al"))):
        c = TrainConfig(method=method, draft_vocab_size=4096, **extra)
        model = build_model(make_model_args(c, target.args))
        model.bind_target(target.tok_embeddings.weight, target.head_weight)
        model.vocab.set_vocab(torch.arange(4096), target.head_weight)
        P, B, N, S = model.args.n_predict, a.rows, a.anchors, a.seq
        g = torch.Generator().manual_seed(0)
        ints = lambda *shape: torch.randint(0, 4096, shape, generator=g)  # noqa: E731
        b = dict(feats=torch.randn(B, S, len(model.args.target_layers) * target.args.dim, generator=g),
                 anchors=torch.randint(1, S - P - 2, (B, N), generator=g), last=ints(B, N), labels=ints(B, N, P),
                 data_next=ints(B, N, P), valid=torch.ones(B, N, P, dtype=torch.bool), top_ids=ints(B, N, P, 8),
                 top_logp=torch.log_softmax(torch.randn(B, N, P, 8, generator=g), -1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for mode in ("fp32", "bf16"):
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                    loss = sum(loss_terms(model, b, c)[0].values())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
            out[f"{method}_{mode}_s"] = round(statistics.median(times[2:]), 3)
        out[f"{method}_bf16_speedup"] = round(out[f"{method}_fp32_s"] / out[f"{method}_bf16_s"], 2)
    out.update(threads=a.threads, rows=a.rows, anchors=a.anchors, seq=a.seq)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
