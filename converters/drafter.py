"""SpecBlock / DBlast drafter checkpoints <-> blockspec drafter GGUF (layout: converters/keys.py).

    convert_drafter(ckpt, out_path, outtype="f16", target=None) -> Path
    read_drafter_gguf(path) -> (torch module, meta)
    read_drafter_meta(path) -> dict              (no torch: for the ggml backend's pairing check)
    target_fingerprint(target_gguf) -> dict;  check_pairing(drafter_meta, fingerprint)

One registered converter class per drafter kind; each overrides only what differs from the common
frame (its extra hyperparameters, and how they are read back). Tensors keep their torch shapes
(gguf-py writes dims reversed, so a Linear weight [out, in] has ggml ne = [in, out]); norms,
biases, queries, the mask embedding, d2t and the rank head stay F32, other 2-D weights follow
`outtype`. A drafter records the fingerprint of the target it was trained on, and both backends
refuse to pair it with a target that differs in vocabulary, width, depth or tokenizer.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from blockspec.converters.gguf_out import gguf_writer
from blockspec.converters.keys import ARCH_ARGS_KEYS, ARCHS, ARGS_KEYS, Keys, gguf_to_torch_name, keep_f32, \
    torch_to_gguf_name
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.gguf_header import GGUFHeader

OUTTYPES = ("f32", "f16", "q8_0")
Q8_BLOCK = 32

CONVERTERS: dict[str, type["DrafterConverter"]] = {}


def register(cls):
    CONVERTERS[cls.arch] = cls
    return cls


# ------------------------------------------------------------------------------ reading GGUF files
def _open_gguf(path: str | os.PathLike, what: str):
    import gguf

    p = Path(path)
    if not p.is_file():
        raise BlockspecError(f"{what} {p} does not exist")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # gguf-py raises ValueError/IndexError/struct/numpy errors on bad files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise BlockspecError(f"{p} is not a readable GGUF file ({first}): truncated or corrupt?") from None
    size = p.stat().st_size
    for t in reader.tensors:  # a truncated data section may still parse: check every tensor fits
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise BlockspecError(f"{p} is truncated: tensor {t.name} ends at byte "
                                 f"{int(t.data_offset) + int(t.n_bytes)}, the file has {size}")
    return reader


def _value(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


_INT_TYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def read_gguf_tensors(path: str | os.PathLike, names) -> dict[str, np.ndarray]:
    """The tensors `names` of any GGUF as float32 numpy (integer tensors keep their type) in torch
    layout ([out, in] for matrices),
    without gguf.GGUFReader's full parse of the metadata (seconds for a large vocabulary).
    Absent names are left out; BlockspecError, one line, for an unreadable file."""
    import gguf

    try:
        h = GGUFHeader(str(path))
        infos = h.tensor_infos()
    except (ValueError, OSError) as e:
        raise BlockspecError(f"{path} is not a readable GGUF file ({e}): truncated or corrupt?") from None
    out = {}
    for name in names:
        if name not in infos:
            continue
        dims, ttype, off = infos[name]
        qtype = gguf.GGMLQuantizationType(ttype)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(dims[1:], dtype=np.int64))
        row_bytes = dims[0] // block * type_size
        if off + rows * row_bytes > len(h.buf):
            raise BlockspecError(f"{path} is truncated: tensor {name} ends past the end of the file")
        raw = np.frombuffer(h.buf, dtype=np.uint8, count=rows * row_bytes, offset=off).reshape(rows, row_bytes)
        if qtype.name in _INT_TYPES:
            out[name] = raw.view(_INT_TYPES[qtype.name]).reshape(tuple(reversed(dims))).copy()
        else:
            data = gguf.quants.dequantize(raw, qtype)
            out[name] = np.array(data, dtype=np.float32).reshape(tuple(reversed(dims)))
    return out


# ------------------------------------------------------------------------------ target fingerprint
@lru_cache(maxsize=8)
def _fingerprint_cached(path: str, mtime: float, size: int) -> tuple:
    try:
        h = GGUFHeader(path)
    except (ValueError, OSError) as e:
        raise BlockspecError(f"{path} is not a readable GGUF file ({e}): truncated or corrupt?") from None
    arch = h.fields.get("general.architecture")
    if not arch:
        raise BlockspecError(f"{path} has no general.architecture: not a model GGUF")
    n_vocab = h.n_tokens
    if n_vocab is None:  # a tokenizer-less test target: the embedding rows
        try:
            emb = h.tensor_shapes().get("token_embd.weight")
        except ValueError as e:
            raise BlockspecError(f"{path} is not a readable GGUF file ({e}): truncated or corrupt?") from None
        n_vocab = emb[1] if emb else h.fields.get(f"{arch}.vocab_size", 0)
    fp = dict(arch=str(arch), n_vocab=int(n_vocab),
              n_embd=int(h.fields.get(f"{arch}.embedding_length", 0)),
              n_layer=int(h.fields.get(f"{arch}.block_count", 0)),
              tokenizer_sha256=h.token_sha256)
    h.buf.close()
    return tuple(fp.items())


def target_fingerprint(target_gguf_path: str | os.PathLike) -> dict:
    """{arch, n_vocab, n_embd, n_layer, tokenizer_sha256} of a target GGUF (cached per file version)."""
    p = Path(target_gguf_path)
    if not p.is_file():
        raise BlockspecError(f"target GGUF {p} does not exist")
    st = p.stat()
    return dict(_fingerprint_cached(str(p.resolve()), st.st_mtime, st.st_size))


def check_pairing(drafter_meta: Mapping[str, Any], target_fp: Mapping[str, Any]) -> None:
    """Refuse a drafter that does not fit the target: one line naming the mismatch.

    drafter_meta: {"model_args": {...}, "target_fingerprint": {...} (optional), "path": ...}
    (what `read_drafter_gguf` returns, or a checkpoint's drafter.json); target_fp: `target_fingerprint`."""
    a = drafter_meta.get("model_args", drafter_meta)
    where = f"drafter {drafter_meta.get('path') or a.get('model_type', '?')}"
    if int(a["vocab_size"]) != int(target_fp["n_vocab"]):
        raise BlockspecError(f"{where} was trained for a vocabulary of {a['vocab_size']} tokens, "
                             f"the target has {target_fp['n_vocab']}")
    if int(a["target_dim"]) != int(target_fp["n_embd"]) or int(a["dim"]) != int(target_fp["n_embd"]):
        raise BlockspecError(f"{where} reads target states of width {a['target_dim']} (drafter width {a['dim']}), "
                             f"the target's width is {target_fp['n_embd']}")
    n_layer = int(target_fp["n_layer"])
    bad = [int(lid) for lid in a["target_layers"] if not 0 <= int(lid) < n_layer]
    if bad:
        raise BlockspecError(f"{where} reads target layers {list(a['target_layers'])}, but the target has "
                             f"{n_layer} layers (0..{n_layer - 1}): {bad} out of range")
    fp = drafter_meta.get("target_fingerprint") or {}
    mine, theirs = fp.get("tokenizer_sha256") or "", target_fp.get("tokenizer_sha256") or ""
    if mine and theirs and mine != theirs:
        raise BlockspecError(f"{where} was trained with another tokenizer (sha256 {mine[:12]}..), "
                             f"the target's tokenizer is {theirs[:12]}..")
    if fp.get("arch") and fp["arch"] != target_fp["arch"]:
        raise BlockspecError(f"{where} was trained on a {fp['arch']} target, this target is {target_fp['arch']}")
    if fp.get("n_layer") and int(fp["n_layer"]) != n_layer:
        raise BlockspecError(f"{where} was trained on a {fp['n_layer']}-layer target, "
                             f"this target has {n_layer} layers")


# ------------------------------------------------------------------------------ converters
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
        a = self.args
        for field, (tmpl, kind) in ARGS_KEYS.items():
            _add(w, Keys.of(tmpl, self.arch), getattr(a, field), kind)
        w.add_uint32(Keys.of(Keys.VALUE_LENGTH, self.arch), int(a.head_dim))
        for field, key in Keys.FINGERPRINT.items():
            v = self.fingerprint.get(field)
            if field in ("arch", "tokenizer_sha256"):
                w.add_string(key, str(v or ""))  # add_string drops "" (a tokenizer-less target)
            else:
                w.add_uint32(key, int(v))

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

    # ---- reading back
    @classmethod
    def args_from_gguf(cls, reader, tensors: Mapping[str, Any]) -> dict:
        """model_args dict from the metadata (plus what only tensor shapes carry)."""
        args = {"model_type": cls.arch}
        for field, (tmpl, kind) in {**ARGS_KEYS, **ARCH_ARGS_KEYS[cls.arch]}.items():
            key = Keys.of(tmpl, cls.arch)
            v = _value(reader, key)
            if v is None:
                raise BlockspecError(f"{reader.data.filename}: drafter metadata key {key} is missing")
            if kind == "i32[]":
                args[field] = [int(i) for i in v]
            elif kind == "f32":  # shortest decimal of the stored f32: 1e-06, not 9.99999997e-07
                args[field] = float(str(np.float32(v)))
            else:
                args[field] = int(v)
        return args


@register
class SpecBlockConverter(DrafterConverter):
    arch = "specblock"

    def set_gguf_parameters(self, w) -> None:
        super().set_gguf_parameters(w)
        _add(w, Keys.of(Keys.RANK_WIDTHS, self.arch), self.args.rank_widths, "i32[]")
        w.add_uint32(Keys.of(Keys.RANK_TOP_K, self.arch), int(self.args.rank_top_k))

    @classmethod
    def args_from_gguf(cls, reader, tensors):
        args = super().args_from_gguf(reader, tensors)
        fc1 = tensors.get("blockspec.rank_fc1.weight")
        if fc1 is not None:  # rank_hidden has no key of its own: fc1 is [rank_hidden, H + 2*top_k]
            args["rank_hidden"] = int(fc1.shape[-1])
        return args


@register
class DBlastConverter(DrafterConverter):
    arch = "dblast"

    def set_gguf_parameters(self, w) -> None:
        super().set_gguf_parameters(w)
        w.add_uint32(Keys.of(Keys.N_CATEGORIES, self.arch), int(self.args.n_categories))

    @classmethod
    def args_from_gguf(cls, reader, tensors):
        args = super().args_from_gguf(reader, tensors)
        args["qk_norm"] = "blk.0.attn_q_norm.weight" in tensors  # the norms' presence is the flag
        return args


def _add(w, key: str, value, kind: str) -> None:
    import gguf

    if kind == "u32":
        w.add_uint32(key, int(value))
    elif kind == "f32":
        w.add_float32(key, float(value))
    elif kind == "i32[]":
        w.add_key_value(key, [int(v) for v in value], gguf.GGUFValueType.ARRAY,
                        sub_type=gguf.GGUFValueType.INT32)
    else:
        raise ValueError(kind)


def _torch():
    import torch

    return torch


# ------------------------------------------------------------------------------ public API
def convert_drafter(ckpt, out_path: str | os.PathLike, outtype: str = "f16",
                    target: str | os.PathLike | None = None) -> Path:
    """Write the drafter `ckpt` (a `blockspec train` checkpoint dir, or a drafter module) as GGUF.

    target: the GGUF of the target it pairs with (its fingerprint is recorded and checked now);
    None takes the target path recorded in the checkpoint's config."""
    if outtype not in OUTTYPES:
        raise BlockspecError(f"unknown outtype {outtype!r} (one of {', '.join(OUTTYPES)})")
    if isinstance(ckpt, (str, os.PathLike)):
        from blockspec.runtime.drafters.torch_backend import load_checkpoint

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


def _read_meta(path, reader) -> dict:
    arch = _value(reader, Keys.ARCHITECTURE)
    if arch not in CONVERTERS:
        raise BlockspecError(f"{path} is a {arch!r} GGUF, not a blockspec drafter ({' or '.join(ARCHS)})")
    margs = CONVERTERS[arch].args_from_gguf(reader, {t.name: t for t in reader.tensors})
    fingerprint = {f: _value(reader, k) for f, k in Keys.FINGERPRINT.items()}
    ftype = _value(reader, "general.file_type")
    return dict(model_args=margs, target_fingerprint={k: v for k, v in fingerprint.items() if v is not None},
                path=str(path), format="gguf", outtype={0: "f32", 1: "f16", 7: "q8_0"}.get(ftype, str(ftype)))


def read_drafter_meta(path: str | os.PathLike) -> dict:
    """A drafter GGUF's metadata without torch: {model_args (from the file's keys), target_fingerprint,
    path, format: "gguf", outtype}; enough for `check_pairing` (the ggml backend's load-time check)."""
    return _read_meta(path, _open_gguf(path, "drafter GGUF"))


def read_drafter_gguf(path: str | os.PathLike):
    """(torch drafter module, meta) from a drafter GGUF; meta as `read_drafter_meta`, with the
    module's full model_args. BlockspecError, one line, for anything that is not one."""
    torch = _torch()
    import gguf

    from blockspec.models import build_model

    reader = _open_gguf(path, "drafter GGUF")
    meta = _read_meta(path, reader)
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
    meta["model_args"] = _args_dict(model.args)
    return model.eval(), meta
