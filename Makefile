# Two commands for a fresh machine (no GPU needed):
#   make demo   sets up .venv and runs `flashtile demo`
#   make test   sets up .venv and runs the CPU test suite (NumPy reference, torch path,
#               Triton kernels under TRITON_INTERPRET=1, sm90 compile checks)
#   make test-quick   the same without the slow tests
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch 2.13.0 is the CPU build on this project's machines (a plain `torch` pulls a
# multi-GB CUDA build); triton 3.6.0 is what the GPU machine runs; the triton 3.6
# interpreter needs numpy < 2.4.
CPU_GPU_STACK := torch==2.13.0 triton==3.6.0 "numpy>=1.23,<2.4"

.PHONY: demo test test-quick test-exhaustive test-gpu clean

$(VENV)/.stamp: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(CPU_GPU_STACK) -e ".[test,plot,transformers]" tqdm
	touch $@

demo: $(VENV)/.stamp
	$(VENV)/bin/flashtile demo

test: $(VENV)/.stamp
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not gpu and not exhaustive" -n 2 --maxschedchunk 1 -q

# The compile checks make test leaves out (pyproject's `exhaustive` marker): the sm90 table at
# d64/d256 (and the dynamic-schedule forward's), the packed-sequence, flex, wide-head-dim and
# split-backward kernels, the forward experiment; and the API fuzz (tests/api/test_fuzz.py,
# FUZZ_EXAMPLES calls a test). Run it after changing a kernel; about 4 minutes on 2 cores.
test-exhaustive: $(VENV)/.stamp
	TRITON_INTERPRET=1 $(PY) -m pytest -m "exhaustive and not gpu" -n 2 --maxschedchunk 1 -q

# The inner loop: the same without the tests marked slow (the sm90 compile checks and the
# largest interpreter cases; tests/conftest.py), in a few minutes.
test-quick: $(VENV)/.stamp
	TRITON_INTERPRET=1 $(PY) -m pytest -m "not gpu and not slow and not exhaustive" -n 2 -q

# On a GPU machine with torch and triton already installed (no venv):
test-gpu:
	PYTHONPATH=src $(PYTHON) -m pytest -m gpu -q

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
