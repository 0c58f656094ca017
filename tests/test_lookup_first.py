"""`specblock+ngram` / `dblast+ngram` (drafters/ngram.py LookupFirst): n-gram lookup drafts where the
history repeats, the shipped model drafter elsewhere. Both kinds of step happen on a repetitive
prompt, the model drafter still sees every committed row, and greedy output equals plain decoding."""

from __future__ import annotations

import pytest

from blockspec.runtime.engine.generate import generate
from blockspec.runtime.engine.sampling import SamplingParams
from blockspec.runtime.engine.setup import make_drafter
from blockspec.runtime.errors import BlockspecError
from blockspec.runtime.llama.prompt import prompt_tokens
from blockspec.runtime.llama.target import Target, TargetConfig

REPEAT = "Write the numbers from 1 to 30 as a Python list, then write the same list again."


@pytest.fixture(scope="module")
def target(smollm2_path):
    with Target(smollm2_path, TargetConfig(n_ctx=1024, n_seq_max=8)) as t:
        yield t


@pytest.mark.parametrize("method", ["specblock+ngram", "dblast+ngram"])
def test_lookup_first_is_lossless_and_uses_both(target, method):
    d = make_drafter(method, block_size=4)
    prompt = prompt_tokens(target, REPEAT)
    plain = generate(target, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0))
    spec = generate(target, prompt, max_tokens=96, sampling=SamplingParams(temperature=0.0), drafter=d)
    assert spec.tokens == plain.tokens
    assert spec.stats.method == method
    assert d.lookup_steps > 0, "the lookup never drafted on a prompt that repeats itself"
    assert d.lookup_steps < spec.stats.target_passes - 1, "the model drafter never drafted"  # - the prefill
    assert len(d.model.tokens) == len(prompt) + len(spec.tokens) - 1  # it held every committed row


def test_lookup_first_sampled_runs_and_bad_names_fail(target):
    d = make_drafter("specblock+ngram", block_size=3)
    out = generate(target, prompt_tokens(target, REPEAT), max_tokens=48,
                   sampling=SamplingParams(temperature=0.7, seed=3), drafter=d)
    assert out.tokens and out.stats.acceptance == "rejection"
    with pytest.raises(BlockspecError, match="specblock\\+ngram or dblast\\+ngram"):
        make_drafter("ngram+ngram")
    with pytest.raises(BlockspecError, match="fixed block size"):
        make_drafter("specblock+ngram", block_size="auto")
