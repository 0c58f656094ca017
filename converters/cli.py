"""`blockspec convert ...`: thin click commands over the converter functions (heavy imports
inside the commands, so `blockspec --help` stays instant)."""

from __future__ import annotations

import click

from .target import OUTTYPES as TARGET_TYPES


@click.group()
def convert():
    """Convert checkpoints to GGUF: drafters, BlockPilot MLPs, Hugging Face targets."""


@convert.command("drafter")
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--outtype", type=click.Choice(["f32", "f16", "q8_0"]), default="f16", show_default=True,
              help="type of the 2-D matmul weights (norms, biases, mask/pos embeddings stay f32)")
@click.option("--target", "target", type=click.Path(exists=True, dir_okay=False), default=None,
              help="target GGUF: fingerprint the drafter to it (required for --layout upstream-dflash "
                   "and for a z-lab DFlash checkpoint: it supplies the embeddings, head and tokenizer)")
@click.option("--layout", type=click.Choice(["blockspec", "upstream-dflash"]), default="blockspec", show_default=True,
              help="blockspec: our specblock/dblast GGUF; upstream-dflash: upstream llama.cpp's `dflash` arch")
def convert_drafter_cmd(ckpt, out, outtype, target, layout):
    """Drafter checkpoint CKPT (ours, or a z-lab DFlash Hugging Face dir) -> GGUF OUT."""
    from pathlib import Path

    from blockspec.runtime.errors import BlockspecError

    from .dflash_hf import is_dflash_hf, load_dflash_hf

    model = ckpt
    if is_dflash_hf(ckpt):
        if target is None:
            raise BlockspecError("a z-lab DFlash checkpoint needs --target TARGET.gguf (its mask token's embedding "
                                 "and the tokenizer come from the target)")
        model = load_dflash_hf(ckpt, target)
    elif not (Path(ckpt) / "drafter.json").is_file():
        raise BlockspecError(f"{ckpt} is neither a blockspec drafter checkpoint (drafter.json + drafter.safetensors) "
                             "nor a DFlash Hugging Face checkpoint (config.json with dflash_config)")
    if layout == "upstream-dflash":
        from .upstream_dflash import export_upstream_dflash

        if target is None:
            raise BlockspecError("--layout upstream-dflash needs --target TARGET.gguf (tokenizer, embeddings, head)")
        path = export_upstream_dflash(model, out, target=target, outtype=outtype)
    else:
        from .drafter import convert_drafter

        path = convert_drafter(model, out, outtype=outtype, target=target)
    click.echo(f"wrote {path}", err=True)


@convert.command("blockpilot")
@click.argument("ckpt", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
def convert_blockpilot_cmd(ckpt, out):
    """BlockPilot checkpoint CKPT (blockpilot.safetensors + blockpilot.json) -> GGUF OUT."""
    from .blockpilot import convert_blockpilot

    click.echo(f"wrote {convert_blockpilot(ckpt, out)}", err=True)


@convert.command("target")
@click.argument("hf_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--quantize", "quantize_type", type=click.Choice(TARGET_TYPES, case_sensitive=False), default="q8_0",
              show_default=True, help="output type (f32/f16/bf16/q8_0 directly, others via llama_model_quantize)")
@click.option("--threads", type=int, default=0, help="quantization threads [default: BLOCKSPEC_THREADS or all cores]")
def convert_target_cmd(hf_dir, out, quantize_type, threads):
    """Hugging Face target checkpoint HF_DIR -> GGUF OUT, via upstream's convert_hf_to_gguf.py."""
    from .target import convert_target

    convert_target(hf_dir, out, quantize_type=quantize_type, threads=threads)
