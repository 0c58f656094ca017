"""Our n-gram lookup against upstream's, replayed on the same greedy text (issue 14's loop gap).

    .venv/bin/python benchmarks/ngram_rules.py [--n-prompts 5] [--max-tokens 256] [--threads N]
        [--costs 1,1.72,2.25,2.66,3.04,3.48,3.93,4.37,4.9] [--json OUT]
    .venv/bin/python benchmarks/ngram_rules.py --cache DIR [--n-answers 600]   # training answers, no target run

In `blockspec bench` our n-gram and upstream's llama.cpp-ngram draft on different text: ours on plain
decoding's greedy answer (batch-invariant kernels), upstream's tool on its own kernels' answer, and an
n-gram lookup's worth depends on how much an answer repeats itself. This replays both lookup rules on
both texts, T = 0 (a drafted token is accepted while it equals the text's next token):
  ours      runtime/drafters/ngram.py: of the latest 8 earlier matches of the last 3 tokens, the one
            agreeing furthest back; block_size tokens of what followed it (a match running into
            the present continues by its period);
  ours-auto the same lookup drafting up to 8 tokens, cut by --block-size auto's policy
            (runtime/engine/policy.py) per match-length class, its pass times set to --costs;
  upstream  common_ngram_simple_draft (llama.cpp common/ngram-map.cpp, --spec-ngram-simple-size-n 3,
            -size-m block_size): the latest match, drafted only if >= 3 tokens follow it in the
            history, at most block_size of them.
Per text and rule: tau, drafted tokens per target pass, and the modelled speed against plain, where a
pass over n rows costs --costs[n-1] plain tokens (the verify-cost curve of benchmarks/verify_cost.py;
the default is the README's 2-core figure). The upstream tool's own tau and drafted/pass on its text
are printed beside its replay, which checks the replay.

`--bench RESULT.json` (a `blockspec bench` result) adds the loop check: for its T = 0 `ngram` and
`llama.cpp-ngram` rows, the measured speed over the speed the curve predicts from the row's own tau
and drafted tokens per pass (each drafting pass taken as a full block). Equal ratios mean the two
loops cost the same per verified row, whatever text each drafted on.

`--cache DIR` (a `blockspec train data` cache) replays the rules on the target's greedy answers to
training prompts instead (the first --n-answers of them; nothing is generated): how the lookup's
rules were chosen without looking at the bench's prompts.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Sequence

from blockspec.runtime.drafters.ngram import NgramDrafter


def ours(history: Sequence[int], block: int) -> list[int]:
    return [int(t) for t in NgramDrafter(block_size=block).propose(history).tokens[1:]]


def upstream(history: Sequence[int], block: int, n: int = 3) -> list[int]:
    """common_ngram_simple_draft: `tokens` there is the history without its last (sampled) token."""
    h = list(history)
    cur = len(h) - 1
    if cur <= n + block + 1:
        return []
    pat = h[len(h) - n:]
    for j in range(cur - n - 1, 0, -1):  # the tool never matches at position 0
        if h[j:j + n] == pat:
            copy = min(block, cur - (j + n))
            return h[j + n:j + n + copy] if copy >= n else []
    return []


class OursAuto:
    """The n-gram drafter under --block-size auto, its verify times taken from the cost curve."""

    def __init__(self, costs: list[float]):
        from blockspec.runtime.engine.policy import SETTLE, DepthPolicy
        from blockspec.runtime.engine.setup import AUTO_NGRAM_DEPTH

        self.depth = AUTO_NGRAM_DEPTH
        self.drafter = NgramDrafter(block_size=self.depth)
        self.policy = DepthPolicy(self.depth)
        self.policy.verify_s = {n + 1: c for n, c in enumerate(costs[:self.depth + 1])}
        self.policy.verify_n = {n: SETTLE for n in self.policy.verify_s}  # settled: no warm-up steps
        self.kind = None

    def __call__(self, history: Sequence[int], block: int) -> list[int]:
        tree = self.drafter.propose(history)
        self.kind = tree.kind
        if len(tree) == 1:
            return []
        k = self.policy.depth(tree.kind, len(tree) - 1, tree.prior)
        return [int(t) for t in tree.tokens[1:k + 1]]

    def feedback(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.policy.kinds[self.kind].record(drafted, accepted)


def replay(texts: list[tuple[list[int], list[int]]], rule: Callable, block: int, costs: list[float]) -> dict:
    passes = emitted = drafted = 0
    cost = 0.0
    for prompt, gen in texts:
        pos = 0
        while pos < len(gen):
            d = rule(prompt + gen[:pos], block)
            a = 0
            while a < len(d) and pos + a < len(gen) and d[a] == gen[pos + a]:
                a += 1
            if hasattr(rule, "feedback"):
                rule.feedback(len(d), a)
            passes += 1
            emitted += a + 1
            drafted += len(d)
            cost += costs[len(d)]
            pos += a + 1
    return dict(tau=round(emitted / passes, 3), drafted_per_pass=round(drafted / passes, 3),
                modelled_speed=round(emitted / cost, 3))


def loop_check(bench_json: str, block: int, costs: list[float]) -> dict:
    """Measured / modelled speed of a bench result's T = 0 n-gram rows (module docstring)."""
    with open(bench_json) as f:
        runs = json.load(f)["runs"]
    out = {}
    for r in runs:
        if r["temperature"] == 0 and r["method"] in ("ngram", "llama.cpp-ngram") and r.get("drafted_per_pass"):
            f_draft = r["drafted_per_pass"] / block  # share of passes that drafted a full block
            modelled = r["tau"] / ((1 - f_draft) * costs[0] + f_draft * costs[block])
            out[r["method"]] = dict(measured=round(r["speedup_vs_plain"], 3), modelled=round(modelled, 3),
                                    ratio=round(r["speedup_vs_plain"] / modelled, 3))
    return out


def cached_answers(cache_dir: str, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy answer) token lists of a data cache's first n greedy (unsampled) answers."""
    from pathlib import Path

    from safetensors import safe_open

    out = []
    for p in sorted(Path(cache_dir).glob("shard_*.safetensors")):
        with safe_open(str(p), "numpy") as f:
            tok, lengths, starts, sampled = (f.get_tensor(k) for k in ("tokens", "lengths", "answer_start", "sampled"))
        at = 0
        for length, start, samp in zip(lengths, starts, sampled):
            if not samp:
                out.append((tok[at:at + start].tolist(), tok[at + start:at + length].tolist()))
            at += int(length)
        if len(out) >= n:
            return out[:n]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="mtbench,humaneval")
    ap.add_argument("--n-prompts", type=int, default=5, help="of each source, as `blockspec bench`")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--costs", default="1,1.72,2.25,2.66,3.04,3.48,3.93,4.37,4.9",
                    help="a pass over 1, 2, ... rows in plain tokens (6-9 rows: the line to the 8-row figure)")
    ap.add_argument("--cache", default=None, help="replay on a `blockspec train data` cache's greedy answers")
    ap.add_argument("--n-answers", type=int, default=600)
    ap.add_argument("--bench", default=None, help="a `blockspec bench` JSON: the loop check (module docstring)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    costs = [float(c) for c in a.costs.split(",")]
    if len(costs) < max(a.block_size, 8) + 1:
        ap.error(f"--costs needs {max(a.block_size, 8) + 1} entries (1..block_size + 1 rows, and 9 for ours-auto)")
    rules = (("ours", ours), ("upstream", upstream), ("ours-auto", lambda: OursAuto(costs)))
    if a.cache:
        texts = cached_answers(a.cache, a.n_answers)
        out = {"settings": vars(a)}
        print(f"{'rule':<9} {'tokens':>6} {'tau':>6} {'drafted/pass':>12} {'modelled':>8}")
        for rname, rule in rules:
            r = replay(texts, rule() if rname == "ours-auto" else rule, a.block_size, costs)
            out[f"{rname}_rule_on_training_answers"] = r
            print(f"{rname:<9} {sum(len(g) for _, g in texts):>6} {r['tau']:>6.3f} {r['drafted_per_pass']:>12.3f} "
                  f"{r['modelled_speed']:>7.3f}x")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return out

    from blockspec.runtime.bench import peers
    from blockspec.runtime.bench.run import METHODS, load_prompts
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.engine.setup import open_speculative
    from blockspec.runtime.llama.prompt import chat_tokens, render_chat

    tool = peers.find_tool()
    texts: dict[str, list] = {"ours": [], "upstream": []}
    tool_tokens = tool_passes = tool_drafted = 0
    greedy = SamplingParams(temperature=0.0)
    target, drafter = open_speculative(None, "ngram", block_size=a.block_size, n_threads=a.threads)
    with target:
        for i, msgs in enumerate(load_prompts(a.prompts, a.n_prompts)):
            tok, text = chat_tokens(target, msgs), render_chat(target, msgs)
            texts["ours"].append((tok, generate(target, tok, max_tokens=a.max_tokens, sampling=greedy,
                                                drafter=drafter).tokens))
            echo = b"".join(target.token_bytes(t, special=True) for t in tok)
            res = peers.run_peer(tool, METHODS["llama.cpp-ngram"].peer, model=target.path,
                                 prompt_text=peers.peer_prompt(target, text, tok), echo=echo,
                                 max_tokens=a.max_tokens, sampling=greedy, seed=i, threads=target.n_threads,
                                 n_ctx=target.n_ctx, block_size=a.block_size, drafter=None, timeout=600)
            texts["upstream"].append((tok, target.tokenize(res.text, add_special=False, parse_special=True)))
            tool_tokens += res.n_tokens
            tool_passes += res.target_passes
            tool_drafted += res.drafted or 0
    out = {"settings": vars(a), "tool_on_its_text": dict(tau=round(tool_tokens / tool_passes, 3),
                                                          drafted_per_pass=round(tool_drafted / tool_passes, 3))}
    print(f"{'text':<9} {'rule':<9} {'tokens':>6} {'tau':>6} {'drafted/pass':>12} {'modelled':>8}")
    for tname, tx in texts.items():
        n = sum(len(g) for _, g in tx)
        for rname, rule in rules:
            r = replay(tx, rule() if rname == "ours-auto" else rule, a.block_size, costs)
            out[f"{rname}_rule_on_{tname}_text"] = dict(tokens=n, **r)
            print(f"{tname:<9} {rname:<9} {n:>6} {r['tau']:>6.3f} {r['drafted_per_pass']:>12.3f} "
                  f"{r['modelled_speed']:>7.3f}x")
    t = out["tool_on_its_text"]
    print(f"upstream's tool as run on its text: tau {t['tau']:.3f}, drafted/pass {t['drafted_per_pass']:.3f}")
    if a.bench:
        out["loop_check"] = loop_check(a.bench, a.block_size, costs)
        for name, r in out["loop_check"].items():
            print(f"{name}: measured {r['measured']:.3f}x, modelled {r['modelled']:.3f}x, ratio {r['ratio']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
