# transformer-mt: `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
# make install: requirements.lock's exact versions and hashes (LOCKED=0: the newest compatible versions)
LOCKED ?= 1
LOCK   := requirements.lock
# make lock: the newest versions uploaded before this day, so that the same command gives the same file
LOCK_DATE ?= 2026-12-06
UV     := uv==0.13.9
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest
WORKERS ?= 2  # make test, make test-slow: tests at a time (pytest-xdist; each worker gets cores / WORKERS threads)

.PHONY: help install lock test test-full lint format clean

help:  ## List the targets
	@grep -hE '^[a-z][a-z0-9_-]*:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "CONFIG (make train): $(EXPERIMENTS) (conf/experiment/)"
	@echo "Scripts, tensorboard and wandb live in $(VENV)/bin/ (e.g. $(VENV)/bin/python scripts/data_stats.py), or activate it: source $(VENV)/bin/activate"

install:  ## Create .venv, install torch (TORCH=torch==2.13.0) first, then requirements.lock's exact set (LOCKED=0: the newest) and this package
	@echo "make install [1/3]: $(VENV) and pip"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	@echo "make install [2/3]: $(TORCH) (the largest step: pip says nothing while it unpacks, 1-3 minutes)"
	$(PY) -m pip install $(TORCH)
ifeq ($(LOCKED),1)
	@echo "make install [3/3]: $(LOCK), every version exact and every file's hash checked; then transformer_mt (editable), nothing resolved again"
	$(PY) -m pip install --require-hashes --no-deps -r $(LOCK)
	$(PY) -m pip install --no-deps --no-build-isolation -e .
	$(PY) -m pip check
else
	@echo "make install [3/3]: transformer_mt (editable) with the dev and export extras, the newest compatible versions"
	$(PY) -m pip install -e ".[dev,export]"
endif
	@$(PY) -c 'from importlib.metadata import version as v; print("make install: done: torch", v("torch") + ", lightning", v("lightning") + ", hydra-core", v("hydra-core") + ", from $(if $(filter 1,$(LOCKED)),$(LOCK) (hashes checked),the newest versions (LOCKED=0)); next: make test")'

# The lock: every dependency but torch (TORCH= picks its build), for Python 3.10 and up on every platform, with every
# file's hash.
lock:  ## Regenerate requirements.lock from pyproject.toml (uv pip compile, versions up to LOCK_DATE, with hashes)
	$(PY) -m pip install --quiet $(UV)
	$(VENV)/bin/uv pip compile pyproject.toml --extra dev --extra export --universal --python-version 3.10 \
		--excludes <(echo torch) --exclude-newer $(LOCK_DATE) --generate-hashes --custom-compile-command "make lock" \
		--quiet -o $(LOCK)

.PHONY: test-slow
test:  ## Run the fast tier: in-process tests, under 3 minutes on 2 cores (not marked slow or cuda), WORKERS=2 at a time
	$(PYTEST) -m "not slow and not cuda" -n $(WORKERS)

test-slow:  ## Run the slow tier only: tests that launch trainings or processes, WORKERS=2 at a time (pytest-xdist)
	$(PYTEST) -m "slow and not cuda" -n $(WORKERS)

test-full:  ## Run every test: the fast and slow tiers, and the cuda tier where a GPU is visible (make gpu-check)
	$(PYTEST)

lint:  ## Check formatting and lint rules with ruff (line length 120, rules in pyproject.toml)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

format:  ## Reformat the code and apply ruff's safe fixes
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:  ## Remove Python and test caches; trained models in outputs/ and multirun/ are kept
	rm -rf .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -not -path './$(VENV)/*' -exec rm -rf {} +

CONFIG ?= multi30k
ARGS   ?=
EXPERIMENTS := $(sort $(basename $(notdir $(wildcard conf/experiment/*.yaml))))

.PHONY: train
# ARGS first: Hydra flags such as -m precede overrides.
train:  ## Train: make train CONFIG=<experiment> [ARGS="key=value ..."] (CONFIG defaults to multi30k; the list below); resume a run: add ARGS="ckpt_path=last hydra.run.dir=<its folder>"
	$(PY) -m transformer_mt.train $(ARGS) experiment=$(CONFIG)

CKPT ?=
SRC  ?=
REF  ?=
RUN  ?=
RUNS ?=
N    ?= 5

.PHONY: evaluate tune translate finish average
need = $(if $($(1)),,$(error $(1) is required: $(2)))

evaluate:  ## Score a checkpoint: make evaluate CKPT=... [SRC=... REF=...] [ARGS=...]
	$(call need,CKPT,make evaluate CKPT=outputs/<date>/<time>/checkpoints/last.ckpt)
	$(PY) -m transformer_mt.evaluate ckpt=$(CKPT) $(if $(SRC),src=$(SRC)) $(if $(REF),ref=$(REF)) $(ARGS)

tune:  ## Choose beam and length penalty on the validation split (§6.1); translate/evaluate then use them: make tune CKPT=... [ARGS=...]
	$(call need,CKPT,make tune CKPT=outputs/<date>/<time>/checkpoints/average-last5.ckpt)
	$(PY) -m transformer_mt.tune ckpt=$(CKPT) $(ARGS)

translate:  ## Translate stdin to stdout: make translate CKPT=... < in.en > out.de
	$(call need,CKPT,make translate CKPT=outputs/<date>/<time>/checkpoints/last.ckpt < in.en > out.de)
	@$(PY) -m transformer_mt.translate ckpt=$(CKPT) $(ARGS)

finish:  ## Finish a run's end-of-run protocol that was interrupted (average, decode, score -> results.json): make finish RUN=outputs/...
	$(call need,RUN,make finish RUN=outputs/<date>/<time>)
	$(PY) -m transformer_mt.finish $(RUN) $(ARGS)

average:  ## Average the last N checkpoints of a run: make average RUN=outputs/... N=5
	$(call need,RUN,make average RUN=outputs/<date>/<time> N=5)
	$(PY) -m transformer_mt.averaging $(RUN) -n $(N)

FORMAT ?= hf
OUT    ?=
TEXT   ?=
LINE   ?= 1

.PHONY: export attention plot
export:  ## Export a checkpoint for transformers or CTranslate2: make export CKPT=... FORMAT=hf|ct2 OUT=<new folder>
	$(call need,CKPT,make export CKPT=outputs/<date>/<time>/checkpoints/last.ckpt FORMAT=hf OUT=exported/hf)
	$(call need,OUT,make export CKPT=... FORMAT=$(FORMAT) OUT=<a folder that does not exist yet>)
	$(PY) -m transformer_mt.tools.export $(CKPT) --format $(FORMAT) --out $(OUT) $(ARGS)

# TEXT and REF reach the script through the environment ("$$TEXT"): quotes and commas inside them are safe.
attention:  ## Attention pictures of one sentence: make attention CKPT=... TEXT="..." [REF="..."], or SRC=<file> LINE=<n> [REF=<file>]
	$(call need,CKPT,make attention CKPT=outputs/<date>/<time>/checkpoints/last.ckpt TEXT="A sentence.")
	$(PY) -m transformer_mt.tools.attention_maps $(CKPT) $(if $(TEXT),--text "$$TEXT") $(if $(SRC),--src $(SRC) --line $(LINE)) \
		$(if $(REF),--ref "$$REF") $(if $(OUT),--out $(OUT)) $(ARGS)

plot:  ## Learning curves of a run as a PNG: make plot RUN=outputs/<date>/<time> (writes <run>/curves.png)
	$(call need,RUN,make plot RUN=outputs/<date>/<time>)
	$(PY) -m transformer_mt.tools.plot $(RUN) $(if $(OUT),--out $(OUT))

.PHONY: table3
table3:  ## Table 3 of a sweep, ours beside the paper's: make table3 RUNS=multirun/<date>/<time> (writes <RUNS>/table3.md)
	$(call need,RUNS,make table3 RUNS=multirun/<date>/<time> (the folder of a CONFIG=table3 or table3_cpu sweep))
	$(PY) -m transformer_mt.tools.table3 $(RUNS)  # RUNS="<dir> <dir>": several sweeps in one table

.PHONY: bench
bench:  ## Speed against peers (transformers, torch.nn.Transformer, CTranslate2) and host overhead beside a bare loop: make bench [CKPT=... SRC=... REF=...] [ARGS=...]
	$(PY) scripts/benchmark.py $(if $(CKPT),--ckpt $(CKPT)) $(if $(SRC),--src $(SRC)) $(if $(REF),--ref $(REF)) $(ARGS)

.PHONY: gpu-check
gpu-check:  ## Tests marked cuda: every GPU path (2 ranks even on one GPU), base's tok/s and MFU through the real Trainer (eager, compiled) beside a bare loop's, waits per update; one table (~7 min on an H200, estimated; needs nothing but the repository): make gpu-check [ARGS="--multi30k DIR"]
	$(PY) scripts/gpu_check.py $(ARGS)
