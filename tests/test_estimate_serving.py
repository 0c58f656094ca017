"""The trainer's held-out estimate predicts serving (issue 13): on the target's own greedy answers
to prompts no drafter trained on, the offline estimates of the shipped SpecBlock agree with the
runtime generating the same answers: the block estimate (blocks anchored uniformly in the answers,
every answer token weighted alike) with its accepted tokens per target pass within sampling noise,
and the serving walk (`walk_acceptance`: serving's own passes replayed offline) with its tau."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prompts import PROMPTS

N_PROMPTS, MAX_NEW = 12, 96


@pytest.mark.heavy
def test_heldout_estimate_matches_runtime_acceptance(smollm2_path, tmp_path):
    from blockspec.models.data_engine import EngineConfig, run_engine
    from blockspec.models.train import evaluate_drafter
    from blockspec.runtime.engine.generate import generate
    from blockspec.runtime.engine.sampling import SamplingParams
    from blockspec.runtime.engine.setup import make_drafter, shipped_drafter
    from blockspec.runtime.format.gguf_header import GGUFHeader
    from blockspec.runtime.llama.prompt import prompt_tokens
    from blockspec.runtime.llama.target import Target, TargetConfig

    drafter = shipped_drafter("specblock")
    layers = [int(x) for x in GGUFHeader(drafter, keep=("specblock.target_layers",)).fields["specblock.target_layers"]]
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:N_PROMPTS]))
    # greedy answers (batches under 64 rows: plain decoding's tokens, see test_data_engine.py)
    run_engine(smollm2_path, [str(prompts)], tmp_path / "data", layers,
               EngineConfig(n_prompts=N_PROMPTS, n_parallel=N_PROMPTS, max_new=MAX_NEW, sample_frac=0.0),
               progress=False)
    est = evaluate_drafter(drafter, str(tmp_path / "data"), str(smollm2_path), n_batches=48, heldout_frac=1.0,
                           walk=True)

    accepted, produced, passes = [], 0, 0
    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_seq_max=16)) as t:
        d = make_drafter("specblock", drafter, None, block_size=4)
        for p in PROMPTS[:N_PROMPTS]:
            t.clear()
            g = generate(t, prompt_tokens(t, p), max_tokens=MAX_NEW, sampling=SamplingParams(), drafter=d)
            hist = list(g.stats.accept_hist)
            produced += g.n_tokens + (g.finish_reason == "stop")  # the bench's count: an EOS is produced
            passes += sum(hist)
            hist[0] -= 1  # the prefill's pass drafts nothing
            accepted += [k for k, n in enumerate(hist) for _ in range(n)]
    accepted = np.array(accepted, float)
    serve = accepted.mean()
    # noise: the runtime's passes (one sample of the answers' blocks) and the estimate's blocks
    se = np.hypot(accepted.std() / np.sqrt(len(accepted)), accepted.std() / np.sqrt(est["blocks"]))
    print(f"estimate {est['accept']:.3f} (first token {est['first_token']:.3f}, {est['blocks']} blocks), "
          f"serving {serve:.3f} over {len(accepted)} passes, se {se:.3f}")
    w = est["walk"]
    print(f"walk: tau {w['tau']:.3f} over {w['passes']} passes; runtime {produced / passes:.3f} over {passes}")
    assert serve > 0.05  # the drafter does get tokens accepted
    assert abs(est["accept"] - serve) <= 3 * se + 0.03
    # the same answers, the same passes: only blocks whose run-time draft differs from the offline one
    # (a few percent, in the last bits of the features) can move the walk off the runtime's count
    assert w["tokens"] == produced
    assert abs(w["tau"] - produced / passes) <= 0.03
