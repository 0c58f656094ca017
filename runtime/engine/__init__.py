"""The engine: `generate` drives a target and a drafter step by step (`speculative`), accepts
losslessly (`acceptance`) from the target's distribution (`sampling`), picks draft depths
(`policy`), and `setup` builds the drafter for a method. May import `drafters/`, `llama/`,
`format/`, `errors`."""
