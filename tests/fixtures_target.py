"""Tiny target GGUFs for the tests: random (or given) weights in the layout models/target.py reads."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from blockspec.models.target import ModelArgs, TargetModel, torch_to_gguf_name


def write_tiny_gguf(path: str | os.PathLike, args: ModelArgs, seed: int = 0,
                    state: Mapping[str, torch.Tensor] | None = None,
                    tokenizer_from: str | os.PathLike | None = None,
                    quant: str | None = None) -> dict[str, torch.Tensor]:
    """Write a random-weight (or given-weight) target GGUF of `args` (F32 tensors) and return the
    torch state it holds (tiny qwen3/qwen2/llama targets for the tests).
    `tokenizer_from`: a GGUF whose tokenizer.* metadata is copied, so llama.cpp can load it.
    `quant`: a gguf quantization type name (e.g. "Q4_1") for the blocks' matmul weights; the
    returned state then holds their dequantized values."""
    import gguf

    torch.manual_seed(seed)
    model = TargetModel(args)
    if state is None:
        for n, p in model.named_parameters():
            with torch.no_grad():
                if n.endswith("norm.weight"):
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 if p.ndim > 1 else 0.02)
        state = model.state_dict()
    w = gguf.GGUFWriter(str(path), args.arch)
    w.add_block_count(args.n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(args.dim)
    w.add_feed_forward_length(args.ffn_dim)
    w.add_head_count(args.n_head)
    w.add_head_count_kv(args.n_kv_head)
    w.add_key_length(args.head_dim)
    w.add_value_length(args.head_dim)
    w.add_rope_freq_base(args.rope_base)
    w.add_layer_norm_rms_eps(args.norm_eps)
    w.add_rope_dimension_count(args.head_dim)
    w.add_vocab_size(args.vocab_size)
    if tokenizer_from is not None:
        for name, field in gguf.GGUFReader(str(tokenizer_from)).fields.items():
            if name.startswith("tokenizer."):
                vtype = field.types[0]
                sub = {"sub_type": field.types[-1]} if vtype == gguf.GGUFValueType.ARRAY else {}
                w.add_key_value(name, field.contents(), vtype, **sub)
    for n, t in state.items():
        g = torch_to_gguf_name(n)
        arr = t.detach().float().numpy()
        if quant is not None and g.startswith("blk.") and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            data = gguf.quants.quantize(arr, qtype)
            w.add_tensor(g, data, raw_dtype=qtype)
            state = {**state, n: torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(arr.shape).copy())}
        else:
            w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: v.detach().clone() for k, v in state.items()}
