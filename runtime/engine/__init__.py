"""The engine: `generate` drives a target and a drafter step by step (`speculative`), accepts
losslessly (`acceptance`) from the target's distribution (`sampling`), picks draft depths
(`policy`), `setup` builds the drafter for a method, and `adapt` updates a SpecBlock drafter
online between requests (`--adapt`). May import `drafters/`, `llama/`, `format/`, `errors`, and
(adapt) the torch models it trains."""
