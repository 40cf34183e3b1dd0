# Entry points on a fresh clone, each idempotent (one stamp per set of packages in .venv):
#   make run         runtime dependencies only (wheels), then the default model generates text
#   make test        adds the test oracles (llama.cpp, torch, transformers, gguf-py, ...), then the test suite
#   make bench-deps  adds what `quanta bench --vs llama.cpp --plot FILE` needs
#   make setup       all of them, running nothing (a developer's environment)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet
RUN_STAMP := $(VENV)/.run-deps
LLAMA_STAMP := $(VENV)/.llama-cpp
TEST_STAMP := $(VENV)/.test-deps
BENCH_STAMP := $(VENV)/.bench-deps
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run test bench-deps setup clean

# llama.cpp (the tests' CPU reference and `quanta bench --vs llama.cpp`) is compiled from source for this CPU, but
# without AMX: a VM may report AMX it does not enable, and ggml's AMX matmul then dies of a protection fault. Built
# outside pip's wheel cache, so that an earlier build with AMX is not reused. A version already installed that
# meets pyproject's requirement is kept (the build takes ~11 minutes on 2 cores).
# (x86 flags: none elsewhere, where a compiler would reject them)
NO_AMX := $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
LLAMA_REQ = $(shell grep -m1 -o '"llama-cpp-python[^"]*"' pyproject.toml | tr -d '"')

$(RUN_STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(LLAMA_STAMP): $(RUN_STAMP)
	CFLAGS="$$CFLAGS $(NO_AMX)" CXXFLAGS="$$CXXFLAGS $(NO_AMX)" $(PIP) --no-cache-dir --no-deps "$(LLAMA_REQ)"
	touch $@

$(TEST_STAMP): $(LLAMA_STAMP)
	$(PIP) -e ".[test]"
	touch $@

$(BENCH_STAMP): $(LLAMA_STAMP)
	$(PIP) -e ".[bench]"
	touch $@

run: $(RUN_STAMP)
	$(VENV)/bin/quanta run "$(PROMPT)"

test: $(TEST_STAMP)
	$(PY) -m pytest -q

bench-deps: $(BENCH_STAMP)

setup: $(TEST_STAMP) $(BENCH_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
