"""A serving session with and without --adapt (issue 15, part 2): SpecBlock's online adaptation.

    .venv/bin/python benchmarks/adapt_session.py [--requests 40] [--max-tokens 128] [--source pycode]
        [--skip 760] [--window 100] [--threads N] [--drafter PATH] [--json OUT]

One target and the shipped SpecBlock drafter (or --drafter) serve the same N requests twice, greedy,
one after another as a server would: first as they are, then with --adapt (a fresh drafter whose
bandit may update it after each request, runtime/engine/adapt.py). Prompts are the first user turns
of a training source of models/data.py (default `pycode`, the standard library's documented
functions to complete; evaluation prompts are dropped by the source), from the --skip'th on, so a
run can start past the prompts the drafter was trained on. Never MT-Bench or HumanEval.

Prints tau (tokens per target pass) per window of --window generated tokens over the session for
both runs, the updates made by kind, and the share of the adapted session's wall time spent
updating; and checks that both runs produced the same tokens (adaptation only changes the drafter).
A pass is one step of the stream (the prefill's token included, as in Stats.tau).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time


def prompts(source: str, skip: int, n: int) -> list[str]:
    from blockspec.models.data import first_user, iter_conversations

    convs = itertools.islice(iter_conversations([source]), skip, skip + n)
    return [first_user(c) for c in convs]


def serve(target, drafter, token_lists, max_tokens: int) -> dict:
    """Run the requests in order: per pass (request, tokens emitted), per request wall seconds,
    stats and tokens."""
    from blockspec.runtime.engine.generate import Stats, generate_stream

    passes, walls, stats, outs = [], [], [], []
    for i, toks in enumerate(token_lists):
        st = Stats(method="plain")
        out: list[int] = []
        t0 = time.perf_counter()
        for new, _ in generate_stream(target, toks, max_tokens=max_tokens, drafter=drafter, stats=st):
            passes.append((i, len(new)))
            out.extend(new)
        walls.append(time.perf_counter() - t0)  # the update after the request is inside the stream
        stats.append(st)
        outs.append(out)
    return dict(passes=passes, walls=walls, stats=stats, tokens=outs)


def windows(passes: list[tuple[int, int]], size: int) -> list[float]:
    """tau over consecutive windows of `size` generated tokens (a pass counts in the window where
    it starts)."""
    taus, n_tok, n_pass = [], 0, 0
    for _, k in passes:
        n_tok += k
        n_pass += 1
        if n_tok >= size:
            taus.append(n_tok / n_pass)
            n_tok = n_pass = 0
    if n_pass:
        taus.append(n_tok / n_pass)
    return taus


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--source", default="pycode", help="a training source of models/data.py")
    ap.add_argument("--skip", type=int, default=760,
                    help="prompts of the source to skip first (pycode: the shipped drafter saw about the first 713)")
    ap.add_argument("--window", type=int, default=100, help="generated tokens per tau window")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("BLOCKSPEC_THREADS", 0)) or 2)
    ap.add_argument("--drafter", default=None, help="SpecBlock drafter GGUF [default: the shipped one]")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    import torch

    from blockspec.runtime.engine.adapt import attach_adapter
    from blockspec.runtime.engine.setup import make_drafter, open_target_for
    from blockspec.runtime.format.modelfile import bundled_model_path
    from blockspec.runtime.llama.prompt import chat_tokens

    torch.set_num_threads(args.threads)
    texts = prompts(args.source, args.skip, args.requests)
    if not texts:
        raise SystemExit(f"no prompts in {args.source} past the first {args.skip}")
    base = make_drafter("specblock", args.drafter, "ggml", block_size=4)
    adapted = make_drafter("specblock", args.drafter, "ggml", block_size=4)
    with open_target_for(bundled_model_path(), [base, adapted], n_threads=args.threads, n_ctx=2048) as t:
        token_lists = [chat_tokens(t, [{"role": "user", "content": p}]) for p in texts]
        token_lists = [x for x in token_lists if len(x) + args.max_tokens < t.n_ctx]
        adapter = attach_adapter(adapted, t)
        runs = {"specblock": serve(t, base, token_lists, args.max_tokens)}
        t.clear()
        runs["specblock --adapt"] = serve(t, adapted, token_lists, args.max_tokens)

    res: dict = dict(requests=len(token_lists), max_tokens=args.max_tokens, source=args.source, skip=args.skip,
                     threads=args.threads, window=args.window)
    for name, r in runs.items():
        gen = sum(len(x) for x in r["tokens"])
        res[name] = dict(tokens=gen, passes=len(r["passes"]), tau=gen / max(1, len(r["passes"])),
                         tau_windows=windows(r["passes"], args.window), wall_s=sum(r["walls"]))
    a = runs["specblock --adapt"]
    upd_s = sum(st.adapt["update_s"] for st in a["stats"])
    res["specblock --adapt"].update(updates=dict(adapter.updates), undone=dict(adapter.undone), update_s=upd_s,
                                    update_share=upd_s / max(1e-9, res["specblock --adapt"]["wall_s"]),
                                    actions=[st.adapt["action"] for st in a["stats"]],
                                    effects=[round(st.adapt["effect"], 4) for st in a["stats"]])
    res["identical_outputs"] = runs["specblock"]["tokens"] == a["tokens"]

    print(f"{res['requests']} requests from {args.source} (after {args.skip}), {args.max_tokens} tokens max, "
          f"{args.threads} thread(s)")
    print(f"{'window':>6}  {'specblock':>9}  {'--adapt':>8}")
    for i, (x, y) in enumerate(itertools.zip_longest(res["specblock"]["tau_windows"],
                                                     res["specblock --adapt"]["tau_windows"])):
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        print(f"{i:>6}  {fmt(x):>9}  {fmt(y):>8}")
    s, ad = res["specblock"], res["specblock --adapt"]
    print(f"tau over the session: {s['tau']:.3f} without, {ad['tau']:.3f} with --adapt")
    print(f"updates kept: {ad['updates']['head']} head, {ad['updates']['full']} full; undone: {ad['undone']['head']} "
          f"head, {ad['undone']['full']} full; {ad['update_s']:.2f} s updating = "
          f"{100 * ad['update_share']:.1f}% of the adapted session's {ad['wall_s']:.1f} s")
    print(f"outputs identical: {'yes' if res['identical_outputs'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
