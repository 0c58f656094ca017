"""`blockspec train ...`: build the feature cache and train drafters.

    blockspec train features --target T.gguf --out CACHE [--sources sharegpt,chitchat] [--n-seqs N]
    blockspec train specblock --target T.gguf --data CACHE --out DIR [--steps N ...]
    blockspec train specblock --target T.gguf --features on-the-fly --out DIR [--n-seqs N ...]
    blockspec train dblast    --target T.gguf --data CACHE --out DIR [--n-categories 4 --loss al ...]

Every TrainConfig field that a method uses is an option of its command (`--batch-size`,
`--no-target-features`, ...; the fields' metadata hold the help and the methods); torch is only
imported inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import dataclasses
import json

import click

from .train import TrainConfig

_HIDDEN = {"method", "target", "out", "data"}
_CHOICES = {"features": ("cache", "on-the-fly"), "precision": ("fp32", "bf16")}


def _config_options(method: str):
    """One click option per TrainConfig field that `method` uses (booleans as --x/--no-x flags),
    with the field's help (TrainConfig's metadata says which methods use it)."""
    def add(fn):
        for f in reversed(dataclasses.fields(TrainConfig)):
            if f.name in _HIDDEN or method not in f.metadata["methods"]:
                continue
            name = f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            hlp = f.metadata["help"]
            if f.type in ("bool", bool):
                if f.name.startswith("no_"):
                    fn = click.option(f"--{name}", f.name, is_flag=True, default=default, help=hlp)(fn)
                else:
                    fn = click.option(f"--{name}/--no-{name}", f.name, default=default, show_default=True,
                                      help=hlp)(fn)
            elif f.name in _CHOICES:
                fn = click.option(f"--{name}", f.name, type=click.Choice(_CHOICES[f.name]), default=default,
                                  show_default=True, help=hlp)(fn)
            elif f.type in ("list", list):
                fn = click.option(f"--{name}", f.name, default="", show_default=True, help=hlp)(fn)
            else:
                typ = {"int": int, "float": float}.get(f.type, str)  # f.type: the annotation's string
                fn = click.option(f"--{name}", f.name, type=typ, default=default, show_default=True, help=hlp)(fn)
        return fn
    return add


def _run(method: str, target: str, out: str, data: str, opts: dict) -> None:
    if isinstance(opts.get("target_layers"), str):
        opts["target_layers"] = [int(x) for x in opts["target_layers"].split(",") if x.strip()]
    cfg = TrainConfig(method=method, target=target, out=out, data=data, **opts)
    from .train import train as run_train

    result = run_train(cfg)
    click.echo(json.dumps(dict(heldout=result, out=out)))


@click.group(name="train")
def train():
    """Train block drafters (torch reference) for a GGUF target."""


def _common(method: str):
    """The options of `blockspec train <method>`: target, out, data, then the method's TrainConfig fields."""
    def add(fn):
        fn = click.option("--data", default="", type=click.Path(),
                          help="feature cache dir (`train data` / `train features`); several self-distilled caches, comma-separated, are read as one; not used with --features on-the-fly")(fn)
        fn = click.option("--out", required=True, type=click.Path(), help="checkpoint dir (resumed if present)")(fn)
        fn = click.option("--target", required=True, type=click.Path(exists=True), help="target GGUF")(fn)
        return _config_options(method)(fn)
    return add


@train.command("specblock")
@_common("specblock")
def specblock_cmd(target, out, data, **opts):
    """SpecBlock: prefix broadcast + position queries + layer-wise shift + rank head."""
    _run("specblock", target, out, data, opts)


@train.command("dblast")
@_common("dblast")
def dblast_cmd(target, out, data, **opts):
    """DBlast: DFlash-style drafter with a categorical latent (--n-categories; 1 = DFlash)."""
    _run("dblast", target, out, data, opts)


@train.command("features")
@click.option("--target", required=True, type=click.Path(exists=True), help="target GGUF")
@click.option("--out", required=True, type=click.Path(), help="cache dir (resumable)")
@click.option("--layers", default="", help="comma-separated layer-input ids; default: 5 spread layers")
@click.option("--sources", default="sharegpt,chitchat", show_default=True, help="comma-separated text sources")
@click.option("--n-seqs", default=2048, show_default=True, help="sequences to cache")
@click.option("--max-len", default=384, show_default=True, help="tokens per sequence window")
@click.option("--shard-size", default=64, show_default=True, help="sequences per shard")
@click.option("--batch-size", default=4, show_default=True, help="sequences per torch target pass")
@click.option("--threads", default=0, show_default=True, help="torch threads (0: torch's default)")
def features_cmd(target, out, layers, sources, n_seqs, max_len, shard_size, batch_size, threads):
    """Compute target features once and cache them as sharded safetensors."""
    from .common import default_layers
    from .data import build_feature_cache
    import gguf

    reader = gguf.GGUFReader(str(target))
    arch = reader.fields["general.architecture"].contents()
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    lids = [int(x) for x in layers.split(",") if x.strip()] or default_layers(n_layer, 5)
    build_feature_cache(target, out, lids, sources=[s for s in sources.split(",") if s], n_seqs=n_seqs,
                        max_len=max_len, shard_size=shard_size, batch_size=batch_size, threads=threads or None)
    click.echo(json.dumps(dict(out=out, layers=lids)))


@train.command("data")
@click.option("--target", required=True, type=click.Path(exists=True), help="target GGUF (llama, qwen2, qwen3)")
@click.option("--prompts", "sources", default="sharegpt,chitchat", show_default=True,
              help="comma-separated: sharegpt, chitchat, pycode, or JSONL files (\"prompt\" or \"messages\" per line); "
                   "SOURCE:N starts that source at its N-th record (fresh prompts for a new run); "
                   "sharegpt-turn2 asks each conversation its second question, after the first exchange")
@click.option("--out", required=True, type=click.Path(), help="cache dir (resumed if present)")
@click.option("--layers", default="", help="comma-separated layer-input ids; default: 5 spread layers")
@click.option("--n-prompts", default=1000, show_default=True, help="prompts to answer over the whole run")
@click.option("--n-parallel", default=32, show_default=True, help="answers decoded together per batch")
@click.option("--max-prompt", default=256, show_default=True, help="skip prompts longer than this (tokens)")
@click.option("--min-prompt", default=0, show_default=True,
              help="skip prompts shorter than this (tokens): e.g. 257 answers what a --max-prompt 256 run skipped")
@click.option("--max-new", default=256, show_default=True, help="answer tokens per prompt at most")
@click.option("--sample-frac", default=0.25, show_default=True,
              help="share of answers sampled at T=1 (runtime sampler defaults); the rest greedy")
@click.option("--top-k", default=8, show_default=True, help="target log-probs stored per position")
@click.option("--shard-size", default=64, show_default=True, help="sequences per shard")
@click.option("--seed", default=0, show_default=True, help="sampling seed (per prompt: seed, prompt index)")
@click.option("--threads", default=0, show_default=True, help="llama.cpp threads (0: all cores)")
@click.option("--worker", default=0, show_default=True, help="answer the prompts with index % workers == worker")
@click.option("--workers", default=1, show_default=True,
              help="processes sharing the run (one thread each beats one many-thread run on a shared CPU)")
@click.option("--eval-set", is_flag=True,
              help="answer evaluation prompts (mtbench, humaneval, JSONL files) greedily, for `train eval` only: "
                   "training refuses the cache")
def data_cmd(target, sources, out, layers, **opts):
    """Self-distillation data: the target answers training prompts in llama.cpp; its layer taps
    and top-k log-probs of every token are cached (resumable, atomic shards)."""
    from blockspec.runtime.format.gguf_header import GGUFHeader

    from .common import default_layers
    from .data_engine import EngineConfig, run_engine

    h = GGUFHeader(target)
    n_layer = int(h.fields.get(f"{h.fields.get('general.architecture')}.block_count", 0))
    lids = [int(x) for x in layers.split(",") if x.strip()] or default_layers(n_layer, 5)
    summary = run_engine(target, [s for s in sources.split(",") if s], out, lids, EngineConfig(**opts))
    click.echo(json.dumps(summary))


@train.command("prompts")
@click.option("--target", required=True, type=click.Path(exists=True), help="target GGUF with a chat template")
@click.option("--out", required=True, type=click.Path(), help="prompts JSONL (resumed if present)")
@click.option("--n-prompts", default=1000, show_default=True, help="questions in the file when done")
@click.option("--n-parallel", default=32, show_default=True, help="questions decoded together per batch")
@click.option("--max-new", default=128, show_default=True, help="tokens per question at most (longer: dropped)")
@click.option("--seed", default=0, show_default=True, help="sampling seed (per question: seed, attempt)")
@click.option("--threads", default=0, show_default=True, help="llama.cpp threads (0: all cores)")
def prompts_cmd(target, out, n_prompts, **opts):
    """Fresh training prompts written by the target: given its chat template up to a user's turn, an
    instruct model writes a user's question (T = 1); duplicates and evaluation prompts are dropped.
    `train data --prompts FILE` answers them."""
    from .self_prompts import generate_prompts

    click.echo(json.dumps(generate_prompts(target, out, n_prompts, **opts)))


@train.command("eval")
@click.option("--drafter", required=True, type=click.Path(exists=True), help="checkpoint dir or drafter GGUF")
@click.option("--data", required=True, help="self-distilled cache (`train data`); several, comma-separated, read as one")
@click.option("--target", required=True, type=click.Path(exists=True), help="target GGUF")
@click.option("--batches", default=32, show_default=True, help="held-out batches of 8 sequences x 16 blocks")
@click.option("--by-source", is_flag=True, help="also the estimate on each prompt source alone (--batches each)")
@click.option("--device", default="auto", show_default=True,
              help="torch device: auto (cuda when this torch has one, else cpu), cpu, cuda, cuda:N")
@click.option("--walk", is_flag=True, help="also replay greedy serving on every held-out answer: tau per target "
              "pass and the accepted-length histogram, as `blockspec bench` counts them")
@click.option("--n-prompts", type=click.IntRange(min=1), default=None,
              help="only the cache's first N prompts (round-robin over its sources: 120 of mtbench,humaneval "
                   "= the bench's --n-prompts 60)")
def eval_cmd(drafter, data, target, batches, by_source, device, walk, n_prompts):
    """Held-out acceptance of a drafter on the target's own answers (what greedy serving sees),
    with tau at each smaller block size the drafter can draft."""
    from .data_engine import prompt_source_names
    from .train import evaluate_drafter

    click.echo(json.dumps(evaluate_drafter(drafter, data, target, n_batches=batches,
                                           by_source=prompt_source_names if by_source else None, device=device,
                                           walk=walk, n_prompts=n_prompts)))


@train.command("store")
@click.option("--data", required=True, help="self-distilled caches (`train data`), comma-separated")
@click.option("--target", required=True, type=click.Path(exists=True), help="the target GGUF that wrote them")
@click.option("--out", required=True, type=click.Path(), help="answer store GGUF to write")
@click.option("--heldout", default=200, show_default=True, type=click.IntRange(min=0),
              help="last answers replayed to calibrate each draft kind's prior")
def store_cmd(data, target, out, heldout):
    """The answer store `--method ngram` drafts from where the context has no match: the token text
    of the target's own answers (no features), as a GGUF for `--drafter`."""
    from .store import store_cli

    store_cli(data, target, out, heldout)


@train.command("average")
@click.option("--a", "a", required=True, type=click.Path(exists=True), help="drafter A (checkpoint dir or GGUF)")
@click.option("--b", "b", required=True, type=click.Path(exists=True), help="drafter B, same shape and draft vocabulary")
@click.option("--out", required=True, type=click.Path(), help="checkpoint dir to write")
@click.option("--weight", default=0.5, show_default=True, help="B's share: (1 - w) * A + w * B")
def average_cmd(a, b, out, weight):
    """Weight-space average of two drafters (checkpoint dirs or GGUFs) of one shape and draft
    vocabulary, e.g. a fine-tune and the drafter it started from."""
    from .checkpoint import average_drafters

    click.echo(json.dumps(dict(out=str(average_drafters(a, b, out, weight)), a=a, b=b, weight=weight)))


@train.command("blockpilot-labels")
@click.option("--target", required=True, type=click.Path(exists=True), help="target GGUF")
@click.option("--method", type=click.Choice(["specblock", "dblast"]), default="specblock", show_default=True,
              help="drafter method whose block size the pilot will choose")
@click.option("--drafter", default=None, type=click.Path(exists=True),
              help="drafter GGUF [default: the one shipped for --method]")
@click.option("--prompts", "sources", default="sharegpt,pycode", show_default=True,
              help="comma-separated: sharegpt, chitchat, pycode, or JSONL files (evaluation prompts are dropped)")
@click.option("--n-prompts", default=200, show_default=True, help="prompts to label over the whole run")
@click.option("--out", required=True, type=click.Path(), help="label dir (resumed if present)")
@click.option("--max-tokens", default=64, show_default=True, help="new tokens per generation")
@click.option("--max-prompt", default=256, show_default=True, help="skip prompts longer than this (tokens)")
@click.option("--block-sizes", default="", help="candidate drafted-token counts, comma-separated "
              "[default: 1..the drafter's trained block]")
@click.option("--temperature", default=0.0, show_default=True, help="0 = greedy")
@click.option("--seed", default=0, show_default=True, help="T > 0: prompt i is sampled with seed + i")
@click.option("--shard-size", default=16, show_default=True, help="prompts per shard")
@click.option("--threads", default=1, show_default=True, help="llama.cpp threads")
def blockpilot_labels_cmd(target, drafter, sources, out, **opts):
    """BlockPilot labels: the runtime at every candidate block size per training prompt (tau,
    tokens/s, step costs, accepted lengths) and the prefill's last-token logits (resumable)."""
    from .blockpilot_data import LabelConfig, run_labels

    summary = run_labels(target, drafter, [s for s in sources.split(",") if s], out, LabelConfig(**opts))
    click.echo(json.dumps(summary))


@train.command("blockpilot")
@click.option("--labels", required=True, type=click.Path(exists=True), help="label dir (`train blockpilot-labels`)")
@click.option("--out", required=True, type=click.Path(), help="checkpoint dir (for `blockspec convert blockpilot`)")
@click.option("--feature-kind", type=click.Choice(["softmax_summary", "raw"]), default="softmax_summary",
              show_default=True, help="input: top-k summary of the prefill's last-token softmax, or the softmax itself")
@click.option("--label", type=click.Choice(["measured", "modelled"]), default="measured", show_default=True,
              help="best b by measured tokens/s, or by tau over the label set's mean step cost")
@click.option("--hidden-dim", default=0, show_default=True,
              help="0: 128 (summary); raw: the widest that keeps the GGUF under 20 MB")
@click.option("--n-layer", default=2, show_default=True, help="hidden layers")
@click.option("--top-k", default=8, show_default=True, help="summary: log-probs summarised")
@click.option("--epochs", default=400, show_default=True, help="full-batch steps")
@click.option("--lr", default=3e-3, show_default=True, help="AdamW learning rate")
@click.option("--weight-decay", default=1e-2, show_default=True, help="AdamW weight decay")
@click.option("--accept-weight", default=1.0, show_default=True, help="weight of the acceptance head's loss")
@click.option("--heldout-frac", default=0.2, show_default=True, help="share of prompts held out (seeded)")
@click.option("--seed", default=0, show_default=True, help="split and init seed")
@click.option("--threads", default=1, show_default=True, help="torch threads")
def blockpilot_cmd(**opts):
    """Train BlockPilot on a label dir; prints the held-out accuracy and regret report."""
    from .blockpilot_train import PilotTrainConfig, train_blockpilot

    click.echo(json.dumps(train_blockpilot(PilotTrainConfig(**opts))))
