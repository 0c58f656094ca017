"""Prompt lookup with 1-, 2- and 3-token minimum matches vs plain decoding, on every other
prompt of tests/prompts.py (SmolLM2-135M, 128 new tokens, greedy). Prints mean tokens/s and
tau per setting. Run: .venv/bin/python benchmarks/ngram_matches.py

A stopgap until `blockspec bench` exists (issue 6); it is what set NgramDrafter's default."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from prompts import PROMPTS  # noqa: E402

from blockspec.runtime.drafters.ngram import NgramDrafter  # noqa: E402
from blockspec.runtime.engine.generate import generate  # noqa: E402
from blockspec.runtime.format.modelfile import bundled_model_path  # noqa: E402
from blockspec.runtime.llama.prompt import prompt_tokens  # noqa: E402
from blockspec.runtime.llama.target import Target, TargetConfig  # noqa: E402


def main() -> None:
    settings = {"plain": None, **{f"ngram min {n}": NgramDrafter(4, n, 3) for n in (1, 2, 3)}}
    res: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    with Target(bundled_model_path(), TargetConfig(n_ctx=2048, n_seq_max=8)) as t:
        for text in PROMPTS[::2]:  # interleaved per prompt, so machine drift cancels
            prompt = prompt_tokens(t, text)
            for name, drafter in settings.items():
                g = generate(t, prompt, max_tokens=128, drafter=drafter)
                res[name].append((g.stats.tokens_per_s, g.stats.tau))
    base = np.mean([r[0] for r in res["plain"]])
    for name, rows in res.items():
        tps, tau = np.mean(rows, axis=0)
        print(f"{name:<12} {tps:6.1f} tok/s ({tps / base:.2f}x plain)  tau {tau:.2f}")


if __name__ == "__main__":
    main()
