"""Torch reference: the target loaded from GGUF, the drafters, their losses, data and training.

`MODEL_TYPES` maps a checkpoint's model_type to the module holding its `ModelArgs` and `Model`
(imported lazily, so importing this package or `blockspec.models.cli` does not load torch).
"""

from __future__ import annotations

import importlib
from typing import Any, Mapping

MODEL_TYPES = {
    "target": "blockspec.models.target",
    "specblock": "blockspec.models.specblock",
    "dblast": "blockspec.models.dblast",
}


def model_module(model_type: str):
    """The module for `model_type`; ValueError naming an unknown type."""
    try:
        return importlib.import_module(MODEL_TYPES[model_type])
    except KeyError:
        raise ValueError(f"unknown model_type {model_type!r} (known: {', '.join(sorted(MODEL_TYPES))})") from None


def build_model(model_args: Mapping[str, Any]):
    """Instantiate a drafter from its model_args dict (as stored in a checkpoint)."""
    mod = model_module(model_args.get("model_type", ""))
    if not hasattr(mod, "Model"):
        raise ValueError(f"model_type {model_args['model_type']!r} cannot be built from args alone")
    return mod.Model(mod.ModelArgs.from_dict(model_args))
