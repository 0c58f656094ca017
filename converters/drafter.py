"""SpecBlock / DBlast drafter checkpoints <-> blockspec drafter GGUF (the format:
runtime/format/drafter_gguf.py).

    convert_drafter(ckpt, out_path, outtype="f16", target=None) -> Path
(reading a drafter back as a torch module: models/checkpoint.py)

One registered converter class per drafter kind; the format writes every key from the model's
args, so a kind overrides only how its tensors are named or stored, where that differs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from blockspec.models.checkpoint import load_checkpoint
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.drafter_gguf import OUTTYPES, check_pairing, gguf_writer, keep_f32, target_fingerprint, \
    torch_to_gguf_name, write_drafter_keys

Q8_BLOCK = 32

CONVERTERS: dict[str, type["DrafterConverter"]] = {}


def register(cls):
    CONVERTERS[cls.arch] = cls
    return cls


class DrafterConverter:
    """Writes one drafter module as GGUF. Subclasses set `arch` and override what differs."""

    arch: str = ""

    def __init__(self, model, fingerprint: Mapping[str, Any], outtype: str = "f16"):
        self.model = model
        self.args = model.args
        self.fingerprint = dict(fingerprint)
        self.outtype = outtype

    # ---- metadata
    def set_gguf_parameters(self, w) -> None:
        write_drafter_keys(w, self.arch, self.args, self.fingerprint)

    # ---- tensors
    def modify_tensors(self, name: str, tensor) -> Iterator[tuple[str, Any]]:
        """(gguf_name, tensor) pairs for one state_dict entry."""
        yield torch_to_gguf_name(name, self.arch), tensor

    def to_numpy(self, gguf_name: str, tensor):
        """-> (array, raw_dtype or None): the stored form of one tensor under `outtype`."""
        import gguf

        if gguf_name == "d2t":  # ABSOLUTE target ids, I32
            return tensor.detach().cpu().to(dtype=_torch().int32).numpy(), None
        x = tensor.detach().cpu().float().numpy()
        if keep_f32(gguf_name, x.ndim) or self.outtype == "f32":
            return x, None
        if self.outtype == "q8_0" and x.shape[-1] % Q8_BLOCK == 0:
            return gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
        return x.astype(np.float16), None  # f16, or q8_0 where the row length does not allow it

    def write(self, out_path: str | os.PathLike) -> Path:
        import gguf

        out = Path(out_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        with gguf_writer(out, self.arch) as w:
            w.add_name(f"blockspec {self.arch} drafter")
            w.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[self.outtype])
            self.set_gguf_parameters(w)
            for name, tensor in self.model.export_state().items():
                if tensor is None:
                    continue
                for gname, t in self.modify_tensors(name, tensor):
                    data, raw = self.to_numpy(gname, t)
                    w.add_tensor(gname, data, raw_dtype=raw)
        return out


@register
class SpecBlockConverter(DrafterConverter):
    arch = "specblock"


@register
class DBlastConverter(DrafterConverter):
    arch = "dblast"


def _torch():
    import torch

    return torch


def convert_drafter(ckpt, out_path: str | os.PathLike, outtype: str = "f16",
                    target: str | os.PathLike | None = None) -> Path:
    """Write the drafter `ckpt` (a `blockspec train` checkpoint dir, or a drafter module) as GGUF.

    target: the GGUF of the target it pairs with (its fingerprint is recorded and checked now);
    None takes the target path recorded in the checkpoint's config."""
    if outtype not in OUTTYPES:
        raise BlockspecError(f"unknown outtype {outtype!r} (one of {', '.join(OUTTYPES)})")
    if isinstance(ckpt, (str, os.PathLike)):
        model, meta = load_checkpoint(ckpt)
        recorded = (meta.get("config") or {}).get("target") or ""
    else:
        model, recorded = ckpt, ""
    arch = getattr(getattr(model, "args", None), "model_type", None)
    if arch not in CONVERTERS:
        raise BlockspecError(f"cannot convert a {arch!r} drafter (known: {', '.join(CONVERTERS)})")
    target = target or recorded
    if not target:
        raise BlockspecError("no target GGUF to fingerprint: pass target= (the checkpoint records none)")
    fp = target_fingerprint(target)
    where = str(ckpt) if isinstance(ckpt, (str, os.PathLike)) else arch
    check_pairing({"model_args": _args_dict(model.args), "path": where}, fp)
    return CONVERTERS[arch](model, fp, outtype).write(out_path)


def _args_dict(args) -> dict:
    import dataclasses

    return dataclasses.asdict(args)
