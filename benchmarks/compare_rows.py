"""One bench row's speed against another's, with its 95% interval: ours against upstream's, where
`blockspec bench` gives each row only against our plain decoding.

    .venv/bin/python benchmarks/compare_rows.py RESULT.json A B [--temperature 1]

A and B are method names in RESULT.json (a `blockspec bench --json` file with per-prompt figures,
from the forty-third session on). Prints one JSON object: each row's speedup over plain, the ratio
A / B of their speeds over the prompts both completed, and its interval by the paired bootstrap over
prompts the bench uses (runtime/bench/run.py: speed_ratio_ci). An interval holding 1 means this
run cannot tell the two apart.
"""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("result", type=click.Path(exists=True, dir_okay=False))
@click.argument("a")
@click.argument("b")
@click.option("--temperature", type=float, default=0.0, show_default=True)
def main(result: str, a: str, b: str, temperature: float) -> None:
    from blockspec.runtime.bench.run import speed_ratio, speed_ratio_ci

    runs = {(r["method"], r["temperature"]): r for r in json.loads(open(result).read())["runs"]}
    rows = []
    for name in (a, b):
        r = runs.get((name, temperature))
        if r is None:
            raise click.ClickException(f"{result}: no row {name} at T = {temperature:g}")
        if "per_prompt" not in r:
            raise click.ClickException(f"{result}: row {name} has no per-prompt figures (a bench run from "
                                       "before the forty-third session)")
        rows.append(r)
    pa, pb = rows[0]["per_prompt"], rows[1]["per_prompt"]
    ratio = speed_ratio(pa, pb)
    print(json.dumps({"temperature": temperature, "prompts": len(set(pa["index"]) & set(pb["index"])),
                      a: rows[0]["speedup_vs_plain"], b: rows[1]["speedup_vs_plain"],
                      "ratio": None if ratio is None else round(ratio, 4),
                      "ratio_ci95": speed_ratio_ci(pa, pb)}, indent=1))


if __name__ == "__main__":
    main()
