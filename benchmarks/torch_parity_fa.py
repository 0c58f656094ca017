"""Parity of the torch reference target (models/target.py) with what the runtime computes:
llama.cpp on the bundled SmolLM2 Q4_1, flash attention on, GGML_BATCH_INVARIANT=1, verify batches
of <= 63 tokens, on >= 192 tokens of real chat text (ShareGPT/chitchat). Prints top-1 agreement,
max logit error and per-layer relative RMS error for the exact emulation (exact=True) and the
default one (emulate_ggml=True); with --no-flash-attn also the default load against llama.cpp
without flash attention (which the torch model does not emulate), for reference.
Run: .venv/bin/python benchmarks/torch_parity_fa.py [--fast-only] [--no-flash-attn]"""

import argparse
import time

import torch

from blockspec.models import target as tgt
from blockspec.models.parity import format_figures, parity_figures, real_text_tokens, runtime_reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fast-only", action="store_true", help="skip exact=True (~1-2 min)")
    ap.add_argument("--no-flash-attn", action="store_true", help="also compare with flash attention off")
    a = ap.parse_args()
    torch.set_num_threads(1)
    path = tgt.bundled_smollm2()
    tokens = real_text_tokens(path)
    ref_logits, ref_taps = runtime_reference(path, tokens)
    runs = [("emulate_ggml=True (default)", dict())]
    if not a.fast_only:
        runs.insert(0, ("exact=True", dict(exact=True)))
    for name, kw in runs:
        t0 = time.time()
        f = parity_figures(tgt.load_target(path, **kw), tokens, ref_logits, ref_taps)
        print(format_figures(f"{name} vs flash attention ({time.time() - t0:.0f} s)", f), flush=True)
    if a.no_flash_attn:
        nofa_logits, nofa_taps = runtime_reference(path, tokens, flash_attn=False)
        f = parity_figures(tgt.load_target(path), tokens, nofa_logits, nofa_taps)
        print(format_figures("emulate_ggml=True vs llama.cpp without flash attention", f))


if __name__ == "__main__":
    main()
