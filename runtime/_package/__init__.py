"""blockspec: block-based lossless speculative decoding for llama.cpp targets.

Subpackages: ``blockspec.runtime`` (engine, bindings, CLI), ``blockspec.models`` (torch
reference drafters and training), ``blockspec.converters`` (checkpoints -> GGUF).
"""

__version__ = "0.1.0"
