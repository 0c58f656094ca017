"""Checkpoints -> GGUF: drafters (`drafter`, `upstream_dflash`, `dflash_hf`), BlockPilot MLPs
(`blockpilot`) and Hugging Face targets (`target`, driving upstream's convert_hf_to_gguf.py).
The `blockspec convert` CLI lives in `cli`. Submodules import their heavy dependencies lazily."""
