"""Every metadata key and tensor name of the blockspec drafter GGUF layout, in one place.

The layout is the fixed contract in FORMAT (see the converter and the llama.cpp drafter graphs,
which read exactly these names). Upstream names are reused where the concept exists
(`{arch}.block_size`, `{arch}.target_layers`, `blk.{i}.attn_q.weight`, ...).

Key templates take the architecture: `Keys.BLOCK_SIZE.format(arch="specblock")`.
Tensor names: `torch_to_gguf_name("layers.0.attn.wq.weight") == "blk.0.attn_q.weight"`, and
`gguf_to_torch_name` inverts it. Pure python (no torch, no gguf import), so anything may import it.
"""

from __future__ import annotations

import re

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
ARGS_KEYS = {
    "dim": (Keys.EMBEDDING_LENGTH, "u32"),
    "n_layer": (Keys.BLOCK_COUNT, "u32"),
    "n_head": (Keys.HEAD_COUNT, "u32"),
    "n_kv_head": (Keys.HEAD_COUNT_KV, "u32"),
    "head_dim": (Keys.KEY_LENGTH, "u32"),
    "ffn_dim": (Keys.FEED_FORWARD_LENGTH, "u32"),
    "norm_eps": (Keys.LAYERNORM_RMS_EPS, "f32"),
    "rope_base": (Keys.ROPE_FREQ_BASE, "f32"),
    "vocab_size": (Keys.VOCAB_SIZE, "u32"),
    "block_size": (Keys.BLOCK_SIZE, "u32"),
    "target_layers": (Keys.TARGET_LAYERS, "i32[]"),
    "target_dim": (Keys.TARGET_EMBEDDING_LENGTH, "u32"),
    "draft_vocab_size": (Keys.DRAFT_VOCAB_SIZE, "u32"),
}
ARCH_ARGS_KEYS = {
    "specblock": {"rank_widths": (Keys.RANK_WIDTHS, "i32[]"), "rank_top_k": (Keys.RANK_TOP_K, "u32")},
    "dblast": {"n_categories": (Keys.N_CATEGORIES, "u32")},
}
