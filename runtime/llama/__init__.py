"""The llama.cpp side: ctypes bindings for our patched symbols (`ext`), the owning wrapper of a
target model and context (`target`), and prompt tokens from the GGUF's chat template (`prompt`).
May import `format/` and `errors`."""
