# transformer-mt: `make help` lists every target.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PYTHON ?= python3
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: help install test test-full lint format clean

help:  ## List the targets
	@grep -hE '^[a-z][a-z0-9_-]*:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN{FS=":.*## "}{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "Scripts, tensorboard and wandb live in $(VENV)/bin/ (e.g. $(VENV)/bin/python scripts/data_stats.py), or activate it: source $(VENV)/bin/activate"

install:  ## Create .venv, install torch (TORCH=torch==2.13.0) first, then this package editable with [dev]
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[dev]"

test:  ## Run the fast test suite (tests not marked slow)
	$(PYTEST) -m "not slow"

test-full:  ## Run every test, the slow ones too
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

.PHONY: train
train:  ## Train: make train CONFIG=base|big|multi30k [ARGS="key=value ..."] (CONFIG defaults to multi30k); resume a run: add ARGS="ckpt_path=last hydra.run.dir=<its folder>"
	$(PY) -m transformer_mt.train $(ARGS) experiment=$(CONFIG)  # ARGS first: Hydra flags such as -m precede overrides

CKPT ?=
SRC  ?=
REF  ?=
RUN  ?=
N    ?= 5

.PHONY: evaluate translate average
need = $(if $($(1)),,$(error $(1) is required: $(2)))

evaluate:  ## Score a checkpoint: make evaluate CKPT=... [SRC=... REF=...] [ARGS=...]
	$(call need,CKPT,make evaluate CKPT=outputs/<date>/<time>/checkpoints/last.ckpt)
	$(PY) -m transformer_mt.evaluate ckpt=$(CKPT) $(if $(SRC),src=$(SRC)) $(if $(REF),ref=$(REF)) $(ARGS)

translate:  ## Translate stdin to stdout: make translate CKPT=... < in.en > out.de
	$(call need,CKPT,make translate CKPT=outputs/<date>/<time>/checkpoints/last.ckpt < in.en > out.de)
	@$(PY) -m transformer_mt.translate ckpt=$(CKPT) $(ARGS)

average:  ## Average the last N checkpoints of a run: make average RUN=outputs/... N=5
	$(call need,RUN,make average RUN=outputs/<date>/<time> N=5)
	$(PY) -m transformer_mt.averaging $(RUN) -n $(N)

.PHONY: bench
bench:  ## Speed of training and decoding against peers: make bench [ARGS="--model base --device cuda"]
	$(PY) scripts/benchmark.py $(ARGS)

.PHONY: gpu-check
gpu-check:  ## Check every GPU path once (<= 8 min on one GPU), summary table at the end: make gpu-check [ARGS="--device cpu"]
	$(PY) scripts/gpu_check.py $(ARGS)
