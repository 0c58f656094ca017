"""`blockspec chat` and `blockspec serve`: thin click commands over runtime/frontends/chat.py and
runtime/frontends/server.py (heavy imports inside the commands, so `blockspec --help` stays instant)."""

from __future__ import annotations

import click

from blockspec.runtime.engine.sampling import ACCEPTANCE

_METHOD_HELP = ("drafter method: plain, ngram, ... [default: the --drafter's method with the n-gram lookup in front "
                "(specblock+ngram, dblast+ngram; with --adapt the drafter alone), else ngram]")
ACCEPTANCE_HELP = ("T > 0 with a drafter: rejection (drafts drawn from the drafter's own distribution) or match "
                   "(deterministic drafts; output equals plain decoding's for the same seed)")
BLOCK_SIZE_HELP = ("drafted tokens per block (at most the drafter's trained block), auto: each step's depth from "
                   "measured costs, or pilot: one size per request chosen by BlockPilot from the prefill's last-token "
                   "distribution  [default: auto for ngram and specblock/dblast+ngram chains, 4 otherwise]")
ADAPT_HELP = ("SpecBlock's online adaptation: after each request a cost-aware bandit may update the drafter "
              "(head or all weights) from the blocks it served; output unchanged (--method specblock, GGUF drafter)")
BLOCKPILOT_HELP = ("BlockPilot GGUF for --block-size pilot (and the acceptance prior of auto) [default: "
                   "<drafter stem>.blockpilot.gguf next to the drafter, when there is one; none: no pilot]")


def _model_options(f):
    f = click.option("--verbose", is_flag=True, help="show llama.cpp's log")(f)
    f = click.option("--adapt", is_flag=True, help=ADAPT_HELP)(f)
    f = click.option("--n-ctx", type=int, default=4096, show_default=True, help="target context length (tokens)")(f)
    f = click.option("--acceptance", type=click.Choice(ACCEPTANCE), default=ACCEPTANCE[0], show_default=True,
                     help=ACCEPTANCE_HELP)(f)
    f = click.option("--blockpilot", default=None, help=BLOCKPILOT_HELP)(f)
    f = click.option("--block-size", default=None, help=BLOCK_SIZE_HELP)(f)
    f = click.option("--drafter-backend", type=click.Choice(["torch", "ggml"]), default=None,
                     help="where a model drafter runs [default: ggml for a GGUF drafter]")(f)
    f = click.option("--method", default=None, help=_METHOD_HELP)(f)
    f = click.option("--drafter", default=None, help="drafter checkpoint (GGUF or torch checkpoint dir), or an answer store GGUF for ngram (`blockspec train store`)")(f)
    f = click.option("--model", default=None,
                     help="GGUF path or fetched model name [default: bundled SmolLM2-135M]")(f)
    return f


@click.command()
@_model_options
@click.option("--temperature", type=float, default=0.2, show_default=True, help="0 = greedy; /temp X changes it")
@click.option("--system", default=None, help="system message")
@click.option("--max-tokens", type=int, default=1024, show_default=True, help="per answer (<= 0: up to the context)")
@click.option("--seed", type=int, default=None, help="sampling seed [default: random]")
def chat(model, drafter, method, drafter_backend, block_size, blockpilot, n_ctx, adapt, acceptance, verbose, temperature,
         system, max_tokens, seed):
    """Interactive chat with streaming answers.

    Commands: /reset, /stats, /temp X, /exit (or Ctrl-D). Ctrl-C stops the current
    answer and keeps the session; the partial answer stays in the history.
    """
    from blockspec.runtime.frontends.chat import run_chat

    run_chat(model=model, drafter=drafter, method=method, drafter_backend=drafter_backend, block_size=block_size,
             blockpilot=blockpilot, temperature=temperature, system=system, max_tokens=max_tokens, n_ctx=n_ctx, seed=seed, verbose=verbose,
             acceptance=acceptance, adapt=adapt)


@click.command()
@_model_options
@click.option("--host", default="127.0.0.1", show_default=True, help="address to listen on")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port to listen on")
@click.option("--model-alias", default=None, help="model id reported by /v1/models [default: the GGUF file name]")
def serve(model, drafter, method, drafter_backend, block_size, blockpilot, n_ctx, adapt, acceptance, verbose, host, port,
          model_alias):
    """OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions (SSE streaming
    with "stream": true) and /v1/models.

    One model, one context: requests are served one at a time, in arrival order (a streamed
    response holds the model until it ends). Listens on 127.0.0.1 unless --host says otherwise.
    """
    from blockspec.runtime.frontends.server import run_server

    run_server(model=model, drafter=drafter, method=method, drafter_backend=drafter_backend, block_size=block_size,
               blockpilot=blockpilot, n_ctx=n_ctx, verbose=verbose, host=host, port=port, model_alias=model_alias, acceptance=acceptance,
               adapt=adapt)
