# Two entry points on a fresh clone: `make run` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: run test setup clean

# llama.cpp (the tests' CPU reference and `quanta bench --vs llama.cpp`) is compiled from source for this CPU, but
# without AMX: a VM may report AMX it does not enable, and ggml's AMX matmul then dies of a protection fault. Built
# outside pip's wheel cache, so that an earlier build with AMX is not reused.
# (x86 flags: none elsewhere, where a compiler would reject them)
NO_AMX := $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip wheel setuptools
	CFLAGS="$$CFLAGS $(NO_AMX)" CXXFLAGS="$$CXXFLAGS $(NO_AMX)" $(PY) -m pip install --quiet --no-cache-dir --force-reinstall --no-deps \
		"$$(grep -m1 -o 'llama-cpp-python[^"]*' pyproject.toml)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/quanta run "$(PROMPT)"

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
