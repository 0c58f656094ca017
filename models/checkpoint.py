"""A drafter from disk as a torch module: a `blockspec train` checkpoint dir or a blockspec drafter
GGUF (the format: runtime/format/drafter_gguf.py). Used by the converters, the torch drafter
backend and training's evaluation."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.drafter_gguf import ARCHS, gguf_to_torch_name, open_drafter_gguf, torch_to_gguf_name

from . import build_model


def read_drafter_gguf(path: str | os.PathLike):
    """(torch drafter module, meta) from a drafter GGUF; meta as `read_drafter_meta`, with the
    module's full model_args. BlockspecError, one line, for anything that is not one."""
    import gguf
    import torch

    reader, meta = open_drafter_gguf(path)
    margs, arch = meta["model_args"], meta["model_args"]["model_type"]
    tensors = {t.name: t for t in reader.tensors}
    try:
        model = build_model(margs)
    except (ValueError, RuntimeError, TypeError, ZeroDivisionError) as e:
        raise BlockspecError(f"{path}: drafter metadata does not describe a valid {arch} drafter ({e})") from None
    expected = model.export_state()
    state = {}
    for gname, t in tensors.items():
        try:
            tname = gguf_to_torch_name(gname, arch)
        except KeyError:
            raise BlockspecError(f"{path}: unexpected tensor {gname!r} in a {arch} drafter") from None
        if tname not in expected:
            raise BlockspecError(f"{path}: tensor {gname} does not fit its own metadata ({arch} drafter)")
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists ne0 first
        if tname == "vocab.d2t":
            x = torch.from_numpy(np.array(t.data, dtype=np.int64).reshape(shape))
        else:
            x = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type),
                                          dtype=np.float32).reshape(shape))
        if tuple(x.shape) != tuple(expected[tname].shape):
            raise BlockspecError(f"{path}: tensor {gname} has shape {list(x.shape)}, its metadata implies "
                                 f"{list(expected[tname].shape)}")
        state[tname] = x
    missing = [torch_to_gguf_name(n, arch) for n in expected if n not in state]
    if missing:
        raise BlockspecError(f"{path}: drafter tensors missing: {', '.join(missing[:4])}")
    model.load_state_dict(state)
    meta["model_args"] = dataclasses.asdict(model.args)
    return model.eval(), meta


def load_checkpoint(path: str | os.PathLike):
    """(model, meta) of a checkpoint dir from `blockspec train` or of a drafter GGUF file;
    BlockspecError, one line, otherwise."""
    d = Path(path)
    if not d.exists():
        raise BlockspecError(f"drafter checkpoint {d} does not exist")
    if d.is_file():  # a drafter is a checkpoint dir or a GGUF file
        return read_drafter_gguf(d)
    if not d.is_dir() or not (d / "drafter.json").is_file() or not (d / "drafter.safetensors").is_file():
        raise BlockspecError(f"{d} is not a drafter checkpoint dir (drafter.json + drafter.safetensors "
                             "from `blockspec train`)")
    try:
        meta = json.loads((d / "drafter.json").read_text())
        margs = meta["model_args"]
    except (ValueError, KeyError, TypeError) as e:
        raise BlockspecError(f"{d}/drafter.json is not a drafter checkpoint's metadata ({e})") from None
    if margs.get("model_type") not in ARCHS:
        raise BlockspecError(f"{d}: model_type {margs.get('model_type')!r} is not a drafter "
                             f"(known: {', '.join(ARCHS)})")
    from safetensors.torch import load_file

    try:
        model = build_model(margs)
        model.load_state_dict(load_file(str(d / "drafter.safetensors")))
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BlockspecError(f"{d}: cannot load drafter weights: {first}") from None
    return model, meta


def average_drafters(a: str | os.PathLike, b: str | os.PathLike, out: str | os.PathLike, weight: float) -> Path:
    """Write (1 - weight) * A + weight * B as a checkpoint dir (a weight-space average of two drafters of
    one shape, e.g. a fine-tune and the drafter it started from; an A with fewer layers, FFN units or taps is first grown as
    `train --n-layer` / `--ffn-dim` / `--target-layers` grows it, which is where a grown B started, and A's head rows follow B's re-picked draft
    vocabulary, B's own rows where A lacks the token). BlockspecError,
    one line, for drafters that cannot be averaged; OUT is written whole or not at all."""
    import shutil

    import torch
    from safetensors.torch import save_file

    if not 0.0 <= weight <= 1.0:
        raise BlockspecError(f"--weight {weight}: expected 0..1")
    (ma, _), (mb, _) = load_checkpoint(a), load_checkpoint(b)
    if dataclasses.replace(ma.args, n_layer=mb.args.n_layer, draft_vocab_size=mb.args.draft_vocab_size,
                           target_layers=mb.args.target_layers, ffn_dim=mb.args.ffn_dim) == mb.args:
        if ma.args.ffn_dim < mb.args.ffn_dim:
            ma.grow_ffn(mb.args.ffn_dim, like=mb)  # B widened from A (`--ffn-dim`): A's new units are B's, muted
        if ma.args.n_layer < mb.args.n_layer:
            ma.grow_layers(mb.args.n_layer)  # B grew from A (`--init A --n-layer`): A as B started from it
        if set(ma.args.target_layers) < set(mb.args.target_layers):
            # B reads more taps (`--init A --target-layers`): A's columns for them are zero, so B's scale
            # there leaves A's function as it was and the average's columns are B's, weighted
            for lid in ma.grow_target_layers(mb.args.target_layers):
                ma.set_layer_scale(lid, mb.layer_scale(lid))
        if ma.vocab.lm_head is not None and mb.vocab.lm_head is not None:
            # B re-picked A's vocabulary (`train --repick-vocab`): A's rows follow their tokens, a token
            # A never had takes B's row, so the average keeps B's row there
            ma.vocab.remap(mb.vocab.d2t, mb.vocab.lm_head.weight)
            ma.args.draft_vocab_size = mb.args.draft_vocab_size
    if dataclasses.asdict(ma.args) != dataclasses.asdict(mb.args):
        raise BlockspecError(f"{a} and {b}: drafters of different shapes cannot be averaged")
    sa, sb = ma.state_dict(), mb.state_dict()
    state = {}
    for k, vb in sb.items():
        va = sa[k].to(vb.dtype)
        if not vb.is_floating_point():
            if not torch.equal(va, vb):
                raise BlockspecError(f"{a} and {b}: different {k}, cannot be averaged")
            state[k] = vb.contiguous()
        else:
            state[k] = ((1.0 - weight) * va + weight * vb).contiguous()
    d = Path(out)
    tmp = d.with_name(d.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "drafter.safetensors"))
    meta = dict(model_args=dataclasses.asdict(mb.args), averaged=dict(a=str(a), b=str(b), weight=weight))
    (tmp / "drafter.json").write_text(json.dumps(meta, indent=1))
    shutil.rmtree(d, ignore_errors=True)
    os.replace(tmp, d)
    return d
