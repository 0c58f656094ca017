"""Parity of the torch reference target (models/target.py) with llama.cpp as the runtime runs it:
the reference logits and layer taps, and the figures comparing a torch model against them. Used by
tests/test_models_target.py and benchmarks/torch_parity_fa.py. Drives llama.cpp (imported inside
`runtime_reference`), so it is a tool above the runtime, like the data engine.
"""

from __future__ import annotations

import numpy as np
import torch

# The reference is runtime/llama/target.py's Target: flash attention on, GGML_BATCH_INVARIANT=1 (set when
# that module is imported), batches of at most VERIFY_CHUNK tokens (a verify batch; a token decoded
# alone gives the same bits), on real chat text (ShareGPT / chitchat rendered with the chat template,
# evaluation prompts excluded).

VERIFY_CHUNK = 63
PARITY_MIN_TOKENS, PARITY_MAX_TOKENS = 192, 256
PARITY_LAYERS = [0, 1, 8, 15, 22, 29]  # layer INPUT ids (0 = token embeddings), as the taps
DECISIVE_MARGIN = 0.5


def real_text_tokens(path, n_min: int = PARITY_MIN_TOKENS, n_max: int = PARITY_MAX_TOKENS) -> list[int]:
    """The first training-mix conversations (ShareGPT and chitchat, round robin, evaluation
    prompts dropped) rendered with the target's chat template, concatenated: n_min..n_max tokens."""
    from blockspec.models.data import ChatTokenizer, iter_conversations

    tok = ChatTokenizer(path)
    ids: list[int] = []
    for conv in iter_conversations(["sharegpt", "chitchat"]):
        ids += tok(conv[:2])
        if len(ids) >= n_min:
            return ids[:n_max]
    raise RuntimeError(f"the data packages hold fewer than {n_min} tokens of conversations")


def runtime_reference(path, tokens: list[int], layers=PARITY_LAYERS, flash_attn: bool = True):
    """llama.cpp's logits [T, V] and layer taps {L: [T, H]} for `tokens` from position 0, decoded
    as the runtime decodes a verify batch (chunks of VERIFY_CHUNK tokens)."""
    from blockspec.runtime.llama.target import Target, TargetConfig

    logits, taps = [], {lid: [] for lid in layers}
    with Target(path, TargetConfig(n_ctx=1024, n_batch=64, flash_attn=flash_attn)) as t:
        if layers:
            t.enable_taps(layers)
        for s in range(0, len(tokens), VERIFY_CHUNK):
            chunk = tokens[s:s + VERIFY_CHUNK]
            t.decode(chunk, range(s, s + len(chunk)), logits=[True] * len(chunk))
            logits += [t.logits_row(i) for i in range(len(chunk))]
            for lid in layers:
                taps[lid].append(t.tap(lid))
    return np.stack(logits), {lid: np.concatenate(v) for lid, v in taps.items()}


def parity_figures(model, tokens, ref_logits, ref_taps) -> dict:
    """Top-1 agreement, logit error and per-layer relative RMS error of `model` against llama.cpp."""
    torch.set_num_threads(1)
    with torch.no_grad():
        logits, states = model(torch.tensor([tokens]), layers=list(ref_taps))
    ours = logits[0].float().numpy()
    same = ours.argmax(-1) == ref_logits.argmax(-1)
    top2 = np.sort(ref_logits, -1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > DECISIVE_MARGIN
    layers = {}
    for lid, ref in ref_taps.items():
        x = states[lid][0].float().numpy()
        layers[lid] = dict(rel_rms=float(np.sqrt(((x - ref) ** 2).mean() / (ref ** 2).mean())),
                           max_abs=float(np.abs(x - ref).max()), bit_equal=float((x == ref).mean()))
    return dict(n=len(tokens), top1=float(same.mean()),
                top1_decisive=float(same[decisive].mean()) if decisive.any() else float("nan"),
                n_decisive=int(decisive.sum()), max_dlogit=float(np.abs(ours - ref_logits).max()),
                mismatches=np.nonzero(~same)[0].tolist(), layers=layers)


def format_figures(name: str, f: dict) -> str:
    lines = [f"{name}: top-1 {f['top1']:.4f} over {f['n']} positions ({f['top1_decisive']:.4f} over the "
             f"{f['n_decisive']} with a llama.cpp top-2 margin > {DECISIVE_MARGIN}), max |dlogit| "
             f"{f['max_dlogit']:.3g}, mismatches at {f['mismatches']}"]
    for lid, e in f["layers"].items():
        lines.append(f"  state {lid:2d}: rel-rms {e['rel_rms']:.2e}  max|d| {e['max_abs']:.3g}  "
                     f"bit-equal {e['bit_equal']:.4f}")
    return "\n".join(lines)
