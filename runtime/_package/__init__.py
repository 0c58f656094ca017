"""blockspec: block-based lossless speculative decoding for llama.cpp targets.

Subpackages: ``blockspec.runtime`` (engine, bindings, CLI), ``blockspec.models`` (torch
reference drafters and training), ``blockspec.converters`` (checkpoints -> GGUF).
"""

__version__ = "0.1.0"


def __getattr__(name):
    # `from blockspec import SpeculativeLlama` without importing llama_cpp at `import blockspec`
    if name == "SpeculativeLlama":
        from blockspec.runtime.frontends.llama_api import SpeculativeLlama

        return SpeculativeLlama
    raise AttributeError(f"module 'blockspec' has no attribute {name!r}")


__all__ = ["SpeculativeLlama", "__version__"]
