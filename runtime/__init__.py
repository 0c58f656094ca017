"""The blockspec runtime: lossless speculative decoding on a patched llama.cpp.

Rooms, lowest first; a room imports only from rooms below it (tests/test_imports.py checks):

  errors.py   the one exception type worded for the user
  format/     what is on disk: GGUF headers, the drafter GGUF format, model files
  llama/      the llama.cpp side: our C bindings, the owning target wrapper, prompt tokens
  drafters/   the drafter interface, its torch and ggml backends, the n-gram peer, the tree
  engine/     generate, the speculative step, acceptance, sampling, the depth policy, BlockPilot, setup
  frontends/  CLI, chat, HTTP server, Python API (`SpeculativeLlama`)
  bench/      `blockspec bench`: our methods against upstream llama.cpp's

`blockspec.models` (torch reference drafters) and `blockspec.converters` (checkpoints -> GGUF)
sit beside the runtime: they may use `format/` and `errors`, and the drafter backends use them.
"""
