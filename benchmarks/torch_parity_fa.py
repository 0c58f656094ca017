"""Top-1 agreement of the torch reference target (models/target.py) with llama.cpp's logits on
the bundled SmolLM2, with flash attention off and on (the runtime uses it on).
Run: .venv/bin/python benchmarks/torch_parity_fa.py"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_models_target import PARITY_TEXT  # noqa: E402

from blockspec.models import target as tgt  # noqa: E402
from blockspec.runtime.target import Target, TargetConfig  # noqa: E402


def main() -> None:
    path = tgt.bundled_smollm2()
    model = tgt.load_target(path)
    for fa in (False, True):
        with Target(path, TargetConfig(n_ctx=1024, flash_attn=fa)) as t:
            toks = t.tokenize(PARITY_TEXT)
            t.decode(toks, range(len(toks)), logits=[True] * len(toks))
            ref = np.stack([t.logits_row(i) for i in range(len(toks))])
        with torch.no_grad():
            ours = model(torch.tensor([toks]))[0][0].numpy()
        agree = float((ours.argmax(-1) == ref.argmax(-1)).mean())
        print(f"flash_attn={fa}: top-1 agreement {agree:.4f} over {len(toks)} positions, "
              f"max |dlogit| {np.abs(ours - ref).max():.3f}")


if __name__ == "__main__":
    main()
