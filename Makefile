# The commands the README names. `make run` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
# CPU build of torch by default; for GPUs: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
NPROC  ?= 2

.PHONY: setup run run-lm test lint unit e2e e2e-down bench clean

setup: $(VENV)/.done
$(VENV)/.done: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# The main job: 2 CPU processes under torchrun on the bundled digits dataset.
run: setup
	$(BIN)/torchrun --standalone --nproc-per-node=$(NPROC) -m ddpjob train --device cpu $(ARGS)

# A small transformer language model on the standard library's own sources (examples/lm.py): one pass
# over 1.9 MB of text, 462 steps of 32 blocks of 128 bytes; README "Language models" has its figures.
LM_ARGS ?= --model examples.lm:tiny_lm --data examples.lm:stdlib_text --run-dir runs/lm --epochs 1 \
	--batch-size 16 --global-batch-size 32 --lr 3e-3 --warmup-steps 30 --weight-decay 0.1 --betas 0.9,0.95 \
	--grad-clip 1.0 --log-every 50
run-lm: setup
	$(BIN)/torchrun --standalone --nproc-per-node=$(NPROC) -m ddpjob train --device cpu $(LM_ARGS) $(ARGS)

lint: setup
	$(BIN)/ruff check src tests examples $(wildcard bench)
	$(BIN)/ruff format --check src tests examples $(wildcard bench)
	$(BIN)/mypy src
	$(BIN)/hadolint docker/Dockerfile
	$(BIN)/shellcheck slurm/*.sbatch docker/*.sh tests/e2e/*.sh tests/gpu/*.sh bench/*.sh .ci/run

# Two at a time, then the timing-sensitive files (the `serial` mark, tests/conftest.py) alone.
unit: setup
	$(BIN)/pytest -q -n 2 -m 'not e2e and not serial'
	$(BIN)/pytest -q -m serial

test: lint unit

# End-to-end tests against a real Docker engine and Slurm daemons (root; installs what they need).
e2e: setup
	bash tests/e2e/provision.sh
	$(BIN)/pytest -q -m e2e tests/e2e

# Benchmarks: each prints a table of medians; figures and how they were taken: bench/README.md.
bench: setup
	cd bench && ../$(BIN)/python loop.py && ../$(BIN)/python lm.py && ../$(BIN)/python startup.py \
		&& ../$(BIN)/python save.py && ../$(BIN)/python load.py && ../$(BIN)/python scale.py

e2e-down:
	bash tests/e2e/teardown.sh

clean:
	rm -rf $(VENV) runs .e2e
