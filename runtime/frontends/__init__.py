"""Front ends over the engine: the `blockspec` CLI (`cli`, `cli_apps`, `api`), the Python API
(`llama_api.SpeculativeLlama`), interactive chat (`chat`) and the HTTP server (`server`). May
import every room below, and the training and converter CLIs it registers."""
