"""What is on disk: GGUF headers read without gguf-py's full parse, the blockspec drafter GGUF
format, and where model files come from. The bottom room: imports only `runtime.errors`."""
