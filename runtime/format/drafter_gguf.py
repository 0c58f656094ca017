"""The blockspec drafter GGUF format, in one place: keys and tensor names, the writer, the reader
and the pairing check with a target. Used by the converters (writing), the torch models (reading a
drafter back) and both drafter backends (header, pairing). No torch; gguf-py imported where used.

The layout is the fixed contract the llama.cpp drafter graphs read (ggml_patches/0006, 0008).
Upstream names are reused where the concept exists (`{arch}.block_size`, `{arch}.target_layers`,
`blk.{i}.attn_q.weight`, ...). Key templates take the architecture: `Keys.of(Keys.BLOCK_SIZE,
"specblock")`. Tensor names: `torch_to_gguf_name("layers.0.attn.wq.weight", arch) ==
"blk.0.attn_q.weight"`, and `gguf_to_torch_name` inverts it. Tensors keep their torch shapes
(gguf-py writes dims reversed, so a Linear weight [out, in] has ggml ne = [in, out]); norms,
biases, queries, the mask embedding, d2t and the rank head stay F32 (`keep_f32`), other 2-D
weights follow the outtype. A drafter records the fingerprint of the target it was trained on
(`target_fingerprint`), and `check_pairing` refuses a target that differs in vocabulary, width,
depth or tokenizer.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.format.gguf_header import GGUFHeader

OUTTYPES = ("f32", "f16", "q8_0")

ARCHS = ("specblock", "dblast")


class Keys:
    """GGUF metadata keys; `{arch}` is "specblock" or "dblast"."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"

    EMBEDDING_LENGTH = "{arch}.embedding_length"                      # u32 drafter width H
    BLOCK_COUNT = "{arch}.block_count"                                # u32 drafter layers
    HEAD_COUNT = "{arch}.attention.head_count"                        # u32
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"                  # u32
    KEY_LENGTH = "{arch}.attention.key_length"                        # u32 head_dim
    VALUE_LENGTH = "{arch}.attention.value_length"                    # u32 head_dim
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"                # u32 ffn_dim
    LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"     # f32
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"                          # f32
    VOCAB_SIZE = "{arch}.vocab_size"                                  # u32, the TARGET vocab
    BLOCK_SIZE = "{arch}.block_size"                                  # u32 specblock K / dblast B
    TARGET_LAYERS = "{arch}.target_layers"                            # i32[] layer-INPUT ids
    TARGET_EMBEDDING_LENGTH = "{arch}.target_embedding_length"        # u32 target width
    DRAFT_VOCAB_SIZE = "{arch}.draft_vocab_size"                      # u32, 0 = target's head
    # specblock only
    RANK_WIDTHS = "{arch}.rank_widths"                                # i32[]
    RANK_TOP_K = "{arch}.rank_top_k"                                  # u32
    # dblast only
    N_CATEGORIES = "{arch}.n_categories"                              # u32, 1 = plain DFlash

    # target fingerprint (no arch prefix)
    TARGET_ARCH = "blockspec.target.arch"                             # str
    TARGET_N_VOCAB = "blockspec.target.n_vocab"                       # u32
    TARGET_N_EMBD = "blockspec.target.n_embd"                         # u32
    TARGET_N_LAYER = "blockspec.target.n_layer"                       # u32
    TARGET_TOKENIZER_SHA256 = "blockspec.target.tokenizer_sha256"     # str

    FINGERPRINT = {  # fingerprint dict field -> key
        "arch": TARGET_ARCH,
        "n_vocab": TARGET_N_VOCAB,
        "n_embd": TARGET_N_EMBD,
        "n_layer": TARGET_N_LAYER,
        "tokenizer_sha256": TARGET_TOKENIZER_SHA256,
    }

    @staticmethod
    def of(template: str, arch: str) -> str:
        return template.format(arch=arch)


# ---------------------------------------------------------------------------------- tensor names
# (torch regex, gguf template); {i} is the torch index. Order = writing order.
_COMMON = [
    (r"fc\.weight", "fc.weight"),
    (r"cond_norm\.weight", "enc.output_norm.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", "blk.{i}.attn_norm.weight"),
    (r"layers\.(\d+)\.attn\.wq\.weight", "blk.{i}.attn_q.weight"),
    (r"layers\.(\d+)\.attn\.wk\.weight", "blk.{i}.attn_k.weight"),
    (r"layers\.(\d+)\.attn\.wv\.weight", "blk.{i}.attn_v.weight"),
    (r"layers\.(\d+)\.attn\.wo\.weight", "blk.{i}.attn_output.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "blk.{i}.ffn_norm.weight"),
    (r"layers\.(\d+)\.ffn\.gate_proj\.weight", "blk.{i}.ffn_gate.weight"),
    (r"layers\.(\d+)\.ffn\.up_proj\.weight", "blk.{i}.ffn_up.weight"),
    (r"layers\.(\d+)\.ffn\.down_proj\.weight", "blk.{i}.ffn_down.weight"),
    (r"norm\.weight", "output_norm.weight"),
    (r"vocab\.lm_head\.weight", "output.weight"),
    (r"vocab\.d2t", "d2t"),
]
_SPECBLOCK = [
    (r"in_proj\.weight", "blockspec.in_proj.weight"),
    (r"pos_query", "blockspec.pos_query"),
    (r"shift\.(\d+)\.weight", "blk.{i+1}.shift.weight"),  # shift i is applied before layer i+1
    (r"rank_head\.0\.weight", "blockspec.rank_fc1.weight"),
    (r"rank_head\.0\.bias", "blockspec.rank_fc1.bias"),
    (r"rank_head\.2\.weight", "blockspec.rank_fc2.weight"),
    (r"rank_head\.2\.bias", "blockspec.rank_fc2.bias"),
]
_DBLAST = [
    (r"mask_embedding", "blockspec.mask_embd"),
    (r"layers\.(\d+)\.attn\.q_norm\.weight", "blk.{i}.attn_q_norm.weight"),  # only with qk_norm
    (r"layers\.(\d+)\.attn\.k_norm\.weight", "blk.{i}.attn_k_norm.weight"),
    (r"category_prior\.weight", "blockspec.cat_prior.weight"),
    (r"category_prior\.bias", "blockspec.cat_prior.bias"),
    (r"category_expander\.weight", "blockspec.cat_expander.weight"),
    (r"category_expander\.bias", "blockspec.cat_expander.bias"),
]
TENSOR_MAP = {"specblock": _COMMON + _SPECBLOCK, "dblast": _COMMON + _DBLAST}

# tensors kept F32 in every outtype (besides every 1-D tensor: norms, biases, mask_embd, d2t)
F32_ALWAYS = ("blockspec.pos_query", "blockspec.mask_embd", "d2t",
              "blockspec.rank_fc1.weight", "blockspec.rank_fc1.bias",
              "blockspec.rank_fc2.weight", "blockspec.rank_fc2.bias")


def _fill(template: str, i: int | None) -> str:
    if i is None:
        return template
    return template.replace("{i+1}", str(i + 1)).replace("{i}", str(i))


def torch_to_gguf_name(name: str, arch: str) -> str:
    """GGUF name of a drafter state_dict entry; KeyError naming an unmapped one."""
    for pat, tmpl in TENSOR_MAP[arch]:
        m = re.fullmatch(pat, name)
        if m:
            return _fill(tmpl, int(m.group(1)) if m.groups() else None)
    raise KeyError(f"{arch}: no GGUF name for torch tensor {name!r}")


def gguf_to_torch_name(name: str, arch: str) -> str:
    """Inverse of `torch_to_gguf_name`; KeyError naming an unknown GGUF tensor."""
    for pat, tmpl in TENSOR_MAP[arch]:
        g = re.escape(tmpl).replace(r"\{i\+1\}", r"(\d+)").replace(r"\{i\}", r"(\d+)")
        m = re.fullmatch(g, name)
        if not m:
            continue
        if not m.groups():
            return pat.replace("\\", "")
        i = int(m.group(1)) - (1 if "{i+1}" in tmpl else 0)
        return re.sub(r"\(\\d\+\)", str(i), pat, count=1).replace("\\", "")
    raise KeyError(f"{arch}: unknown GGUF tensor {name!r}")


def map_tensor_names(names, arch: str):
    """Yield (torch_name, gguf_name) for `names` (a state_dict's keys)."""
    for n in names:
        yield n, torch_to_gguf_name(n, arch)


def keep_f32(gguf_name: str, n_dims: int) -> bool:
    """True for tensors FORMAT keeps F32 whatever the outtype (norms, biases, queries, d2t, rank head)."""
    return n_dims < 2 or gguf_name in F32_ALWAYS


# ModelArgs field -> (key template, gguf value kind); the shared hyperparameters of both archs.
# head_dim is written twice (key_length and value_length); the loader reads key_length.
_KINDS = {"norm_eps": "f32", "rope_base": "f32", "target_layers": "i32[]", "rank_widths": "i32[]"}  # else u32
_FIELDS = dict(dim=Keys.EMBEDDING_LENGTH, n_layer=Keys.BLOCK_COUNT, n_head=Keys.HEAD_COUNT,
               n_kv_head=Keys.HEAD_COUNT_KV, head_dim=Keys.KEY_LENGTH, ffn_dim=Keys.FEED_FORWARD_LENGTH,
               norm_eps=Keys.LAYERNORM_RMS_EPS, rope_base=Keys.ROPE_FREQ_BASE, vocab_size=Keys.VOCAB_SIZE,
               block_size=Keys.BLOCK_SIZE, target_layers=Keys.TARGET_LAYERS,
               target_dim=Keys.TARGET_EMBEDDING_LENGTH, draft_vocab_size=Keys.DRAFT_VOCAB_SIZE)
_ARCH_FIELDS = {"specblock": dict(rank_widths=Keys.RANK_WIDTHS, rank_top_k=Keys.RANK_TOP_K),
                "dblast": dict(n_categories=Keys.N_CATEGORIES)}
ARGS_KEYS = {f: (key, _KINDS.get(f, "u32")) for f, key in _FIELDS.items()}
ARCH_ARGS_KEYS = {arch: {f: (key, _KINDS.get(f, "u32")) for f, key in fields.items()}
                  for arch, fields in _ARCH_FIELDS.items()}


# ---------------------------------------------------------------------------------- writing
@contextmanager
def gguf_writer(out_path: str | os.PathLike, arch: str) -> Iterator:
    """`with gguf_writer(out, arch) as w:` add keys and tensors to `w` (a gguf.GGUFWriter); on a
    clean exit the file is written and renamed to `out`, otherwise the temp file is removed."""
    import gguf

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        yield w
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_drafter_keys(w, arch: str, args, fingerprint: Mapping[str, Any]) -> None:
    """Every metadata key of a drafter: its hyperparameters (ModelArgs `args`) and the fingerprint
    of the target it pairs with."""
    for field, (tmpl, kind) in {**ARGS_KEYS, **ARCH_ARGS_KEYS[arch]}.items():
        _add(w, Keys.of(tmpl, arch), getattr(args, field), kind)
    w.add_uint32(Keys.of(Keys.VALUE_LENGTH, arch), int(args.head_dim))
    write_fingerprint(w, fingerprint)


def write_fingerprint(w, fingerprint: Mapping[str, Any]) -> None:
    """The keys of `target_fingerprint` (what a drafter or answer store pairs with)."""
    for field, key in Keys.FINGERPRINT.items():
        v = fingerprint.get(field)
        if field in ("arch", "tokenizer_sha256"):
            w.add_string(key, str(v or ""))  # add_string drops "" (a tokenizer-less target)
        else:
            w.add_uint32(key, int(v))


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


# ---------------------------------------------------------------------------------- reading
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


def gguf_architecture(path: str | os.PathLike) -> str | None:
    """general.architecture of a GGUF from its header alone; None if the file is not a GGUF."""
    try:
        return GGUFHeader(str(path)).fields.get("general.architecture")
    except (ValueError, OSError):
        return None


def args_from_gguf(reader, arch: str) -> dict:
    """model_args dict of a drafter GGUF from its metadata (plus what only tensor shapes carry)."""
    tensors = {t.name: t for t in reader.tensors}
    args = {"model_type": arch}
    for field, (tmpl, kind) in {**ARGS_KEYS, **ARCH_ARGS_KEYS[arch]}.items():
        key = Keys.of(tmpl, arch)
        v = _value(reader, key)
        if v is None:
            raise BlockspecError(f"{reader.data.filename}: drafter metadata key {key} is missing")
        if kind == "i32[]":
            args[field] = [int(i) for i in v]
        elif kind == "f32":  # shortest decimal of the stored f32: 1e-06, not 9.99999997e-07
            args[field] = float(str(np.float32(v)))
        else:
            args[field] = int(v)
    if arch == "specblock":
        fc1 = tensors.get("blockspec.rank_fc1.weight")
        if fc1 is not None:  # rank_hidden has no key of its own: fc1 is [rank_hidden, H + 2*top_k]
            args["rank_hidden"] = int(fc1.shape[-1])
    if arch == "dblast":
        args["qk_norm"] = "blk.0.attn_q_norm.weight" in tensors  # the norms' presence is the flag
    return args


def _read_meta(path, reader) -> dict:
    arch = _value(reader, Keys.ARCHITECTURE)
    if arch not in ARCHS:
        raise BlockspecError(f"{path} is a {arch!r} GGUF, not a blockspec drafter ({' or '.join(ARCHS)})")
    margs = args_from_gguf(reader, arch)
    fingerprint = {f: _value(reader, k) for f, k in Keys.FINGERPRINT.items()}
    ftype = _value(reader, "general.file_type")
    return dict(model_args=margs, target_fingerprint={k: v for k, v in fingerprint.items() if v is not None},
                path=str(path), format="gguf", outtype={0: "f32", 1: "f16", 7: "q8_0"}.get(ftype, str(ftype)))


def read_drafter_meta(path: str | os.PathLike) -> dict:
    """A drafter GGUF's metadata without torch: {model_args (from the file's keys), target_fingerprint,
    path, format: "gguf", outtype}; enough for `check_pairing` (the ggml backend's load-time check)."""
    return _read_meta(path, _open_gguf(path, "drafter GGUF"))


def open_drafter_gguf(path: str | os.PathLike):
    """(gguf.GGUFReader, meta as `read_drafter_meta`) of a drafter GGUF."""
    reader = _open_gguf(path, "drafter GGUF")
    return reader, _read_meta(path, reader)


def read_drafter_header(path: str | os.PathLike) -> dict:
    """The drafter GGUF's hyperparameters (its model_args), `meta` for the pairing check
    (`read_drafter_meta`), and `d2t` (absolute target ids, or None)."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise BlockspecError(f"drafter GGUF {p} does not exist")
    arch = gguf_architecture(p)  # before gguf-py's full read: a target GGUF takes seconds to parse
    if arch not in ARCHS:
        what = "not a GGUF file" if arch is None else f"a {arch!r} GGUF"
        raise BlockspecError(f"{p} is {what}, not a blockspec drafter ({' or '.join(ARCHS)})")
    meta = read_drafter_meta(p)
    h = dict(meta["model_args"], arch=arch, path=str(p), meta=meta)
    d2t = None
    if h["draft_vocab_size"]:
        t = next((t for t in gguf.GGUFReader(str(p)).tensors if t.name == "d2t"), None)
        if t is None:
            raise BlockspecError(f"{p}: draft_vocab_size {h['draft_vocab_size']} but no d2t tensor")
        d2t = np.array(t.data, dtype=np.int64).reshape(-1)
        if d2t.shape[0] != h["draft_vocab_size"] or d2t.min() < 0 or d2t.max() >= h["vocab_size"]:
            raise BlockspecError(f"{p}: d2t does not map {h['draft_vocab_size']} draft ids into the "
                                 f"target vocabulary of {h['vocab_size']}")
    h["d2t"] = d2t
    return h
