# The commands the README names. `make run` and `make test` each do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
# CPU build of torch by default; for GPUs: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
NPROC  ?= 2
# pip compiles what it installs on one core; compileall compiles the venv on every core afterwards
# (a bytecode cache only: a file it cannot compile, a few written for other Pythons, costs nothing)
PIP     = $(BIN)/pip install -q --no-compile
COMPILE = $(BIN)/python -m compileall -q -j $$(nproc) $(VENV)/lib > /dev/null || true

.PHONY: setup runtime run run-lm shell test lint unit flaky e2e e2e-parallel e2e-serial e2e-down bench clean check process process-beside process-alone process-parallel process-serial provision

# `make run` needs only the runtime (torch and ddpjob's own dependencies); the dev tools (linters,
# trackers, transformers, ...) come with `make setup`, which every test target uses.
runtime: $(VENV)/.runtime
$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) $(TORCH)
	$(PIP) -e .
	$(COMPILE)
	touch $@
setup: $(VENV)/.dev
$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) -e '.[dev]'
	$(COMPILE)
	touch $@

HINT = echo "[make] ddpjob is $(BIN)/ddpjob: run it as such, or 'source $(BIN)/activate', or 'make shell'"

# The main job: 2 CPU processes through `ddpjob launch` on the bundled digits dataset. Ctrl-C saves a
# checkpoint and exits 75; `make run` again resumes.
run: runtime
	@$(HINT)
	$(BIN)/ddpjob launch --nproc-per-node=$(NPROC) --device cpu $(ARGS)

# A shell with the venv active, so that `ddpjob` is on PATH.
shell: runtime
	@$(HINT)
	@bash --rcfile $(BIN)/activate -i

# A small transformer language model on the standard library's own sources (examples/lm.py): one pass
# over 1.9 MB of text, 462 steps of 32 blocks of 128 bytes; README "Language models" has its figures.
LM_ARGS ?= --model examples.lm:tiny_lm --data examples.lm:stdlib_text --run-dir runs/lm --epochs 1 \
	--batch-size 16 --global-batch-size 32 --lr 3e-3 --warmup-steps 30 --weight-decay 0.1 --betas 0.9,0.95 \
	--grad-clip 1.0 --log-every 50
run-lm: runtime
	$(BIN)/ddpjob launch --nproc-per-node=$(NPROC) --device cpu $(LM_ARGS) $(ARGS)

lint: setup
	$(BIN)/ruff check src tests examples $(wildcard bench)
	$(BIN)/ruff format --check src tests examples $(wildcard bench)
	$(BIN)/mypy src
	$(BIN)/hadolint docker/Dockerfile
	$(BIN)/shellcheck -x slurm/*.sbatch slurm/*.sh docker/*.sh tests/*.sh tests/e2e/*.sh tests/gpu/*.sh bench/*.sh .ci/run

# The unit tier: in process, no subprocesses (tests/unit/conftest.py refuses one); seconds.
PYTEST_UNIT = $(BIN)/pytest -q tests/unit
unit: setup
	$(PYTEST_UNIT)

# Real torchrun and subprocesses. The parallel tier (PARALLEL at a time, 3: a third fills the time the
# others sleep in; the tests sharing a reference run or a server on one worker: tests/conftest.py)
# runs as background work (tests/background.sh: nice 19, and a cpu cgroup of weight 128 where root may
# make one) beside the tests that race a deadline (marked `serial` in their file; two at a time, they
# mostly wait), which so get most of a core whenever they ask for one; their output follows the
# parallel tier's. Then those that measure a speed (`alone`: a step time, a link) with nothing beside.
# Ctrl-C reaches both pytests, as TERM or HUP to the recipe does as an interrupt: each ends its tests.
PARALLEL ?= 3
PYTEST_PARALLEL = $(BIN)/pytest -q -n $(PARALLEL) --dist loadgroup -m 'not serial' tests/process
PYTEST_SERIAL = $(BIN)/pytest -q -n 2 --dist loadgroup tests/process -m
# `finish PID`: waits for a job started with &, again while a trapped signal interrupts the wait;
# returns its exit status.
FINISH = finish() { while wait $$1; rc=$$?; [ $$rc -gt 128 ] && kill -0 $$1 2>/dev/null; do :; done; return $$rc; }
process: process-beside
	$(MAKE) --no-print-directory process-alone
process-beside: setup
	@mkdir -p runs
	@$(FINISH); trap 'kill -INT $$pp $$sp 2>/dev/null' TERM HUP; trap : INT; \
	tests/background.sh $(PYTEST_PARALLEL) & pp=$$!; \
	tests/background.sh --normal $(PYTEST_SERIAL) 'serial and not alone' > runs/process-serial.log 2>&1 & sp=$$!; \
	finish $$sp; serial=$$?; finish $$pp; parallel=$$?; \
	echo "---- the serial tests, beside the parallel tier (runs/process-serial.log) ----"; \
	cat runs/process-serial.log; [ $$parallel -eq 0 ] && [ $$serial -eq 0 ]
process-alone: setup
	$(BIN)/pytest -q -m alone tests/process
process-parallel: setup
	$(PYTEST_PARALLEL)
process-serial: setup
	$(PYTEST_SERIAL) serial

# One target at a time, also under make -j: the tiers time themselves against each other's load.
.NOTPARALLEL:

# Before a commit: lint and the unit tier (no processes), side by side (both mostly use one core);
# lint's output follows the unit tier's. Ctrl-C reaches both; TERM or HUP to the recipe ends both
# (the unit tier's pytest by an interrupt, lint's make by TERM, which make passes on to its command).
check: setup
	@mkdir -p runs
	@$(FINISH); trap 'kill -INT $$up 2>/dev/null; kill -TERM $$lp 2>/dev/null' TERM HUP; trap : INT; \
	tests/background.sh --normal $(MAKE) --no-print-directory lint > runs/lint.log 2>&1 & lp=$$!; \
	tests/background.sh --normal $(PYTEST_UNIT) & up=$$!; \
	finish $$up; unit=$$?; finish $$lp; lint=$$?; \
	echo "---- lint, beside the unit tier (runs/lint.log) ----"; cat runs/lint.log; [ $$lint -eq 0 ] && [ $$unit -eq 0 ]

test: check process

# How flaky the timing-sensitive tests are: the `serial` tests N times over, as `make process` runs
# them (beside LOAD busy loops run as background work in place of the parallel tier; LOAD=0 for none;
# the `alone` tests get the loops too, which `make process` spares them), then how many rounds each
# test failed in, with the causes (tests/flaky.py). Not part of `make test` or CI. K narrows it (pytest -k).
N ?= 5
LOAD ?= 2
flaky: setup
	rm -rf runs/flaky && mkdir -p runs/flaky
	@$(FINISH); loops=; round=; trap 'kill $$loops 2>/dev/null' EXIT; trap 'kill -INT $$round 2>/dev/null; exit 143' TERM HUP; \
	trap 'exit 130' INT; \
	for j in $$(seq 1 $(LOAD)); do tests/background.sh $(BIN)/python -c 'while True: pass' & loops="$$loops $$!"; done; \
	for i in $$(seq 1 $(N)); do \
		tests/background.sh --normal $(PYTEST_SERIAL) serial -p no:cacheprovider \
			--junitxml=runs/flaky/round-$$i.xml $(if $(K),-k '$(K)') & round=$$!; \
		finish $$round; echo $$? > runs/flaky/round-$$i.rc; \
	done; $(BIN)/python tests/flaky.py $$(seq -f 'runs/flaky/round-%g.xml' 1 $(N))

# End-to-end tests against a real Docker engine and Slurm daemons (root; installs what they need):
# those that wait on the engine and the cluster, then the ones that time a link or a node (`serial`).
# e2e-parallel and e2e-serial expect a provisioned machine (.ci/run provisions once, beside other work).
e2e: provision  # one after the other, also under make -j: the serial tests time links and nodes
	$(MAKE) e2e-parallel
	$(MAKE) e2e-serial
e2e-parallel: setup
	$(BIN)/pytest -q -m 'e2e and not serial' tests/e2e
e2e-serial: setup
	$(BIN)/pytest -q -m 'e2e and serial' tests/e2e
provision: setup
	bash tests/e2e/provision.sh

# Benchmarks: each prints a table of medians; figures and how they were taken: bench/README.md.
bench: setup
	cd bench && ../$(BIN)/python loop.py && ../$(BIN)/python lm.py && ../$(BIN)/python startup.py && ../$(BIN)/python worker_start.py \
		&& ../$(BIN)/python save.py && ../$(BIN)/python load.py && ../$(BIN)/python scale.py \
		&& ../$(BIN)/python peers.py  # one line and skipped without the peers extra (bench/README.md)

e2e-down:
	bash tests/e2e/teardown.sh

clean:
	rm -rf $(VENV) .e2e runs/*  # runs/ itself stays: Slurm writes the jobs' output there and does not make it
