# recdepth — `make test` and `make train` work on a fresh clone: they install what is missing.
PYTHON      ?= python
PIP         := $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
# Optional: a torch index, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu on a Linux
# box whose pip would otherwise pull the CUDA build.
TORCH_INDEX ?=
ARGS        ?=

.DEFAULT_GOAL := help
.PHONY: help install ensure train test test-slow bench frontier report lint clean

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: ## install torch (pinned, CPU build here) first, then recdepth (editable) with dev extras
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') already installed"; \
	else \
		$(PIP) install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)); \
	fi
	$(PIP) install -e ".[dev]" --config-settings editable_mode=compat  # compat: Hydra finds hydra_plugins/ from any directory

ensure:  # install if anything is missing, or if the recdepth on the path is another checkout
	@$(PYTHON) -I -c "import importlib.metadata as m, pathlib, recdepth, sys; [m.version(p) for p in ('torch', 'lightning', 'hydra-core', 'tiktoken', 'datasets', 'wandb', 'torchmetrics', 'matplotlib', 'safetensors', 'tokenizers', 'pytest', 'hydra-submitit-launcher', 'lm_eval')]; sys.exit(pathlib.Path(recdepth.__file__).resolve().parents[1] != pathlib.Path('$(CURDIR)').resolve())" 2>/dev/null \
		|| $(MAKE) --no-print-directory install

train: ensure ## train + evaluate the paper's grouped model on the shipped corpus (ARGS="key=value ...")
	$(PYTHON) -m recdepth.train model=grouped exit=accel $(ARGS)

test: ensure ## run the test suite (slow tests excluded)
	$(PYTHON) -m pytest -q $(ARGS)

test-slow: ensure ## run only the slow tests
	$(PYTHON) -m pytest -q -m slow $(ARGS)

bench: ensure ## throughput / MFU / cost per layer application, baseline vs grouped
	$(PYTHON) -m recdepth.bench $(ARGS)

frontier: ensure ## exit frontier of a checkpoint: fixed grid, rules, oracle (CKPT=<last.ckpt> OUT=<dir> [ARGS=...])
	@test -n "$(CKPT)" -a -n "$(OUT)" || { echo "make frontier: set CKPT=<path to last.ckpt> and OUT=<new directory>"; exit 2; }
	$(PYTHON) -m recdepth.evaluate --multirun hydra/sweeper=frontier ckpt=$(CKPT) hydra.sweep.dir=$(OUT) $(ARGS)

report: ensure ## every exit rule on one frontier, calibrated and not, and the gate (CKPT=<last.ckpt> OUT=<new dir>)
	@test -n "$(CKPT)" -a -n "$(OUT)" || { echo "make report: set CKPT=<path to last.ckpt> and OUT=<new directory>"; exit 2; }
	$(PYTHON) -m recdepth.report ckpt=$(CKPT) hydra.run.dir=$(OUT) $(ARGS)

lint: ensure ## ruff
	$(PYTHON) -m ruff check recdepth tests

clean: ## remove caches and build outputs (keeps outputs/ and multirun/: your results)
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache
