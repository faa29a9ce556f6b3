# Two commands on a fresh machine:  `make demo` (main job) and `make test` (the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build on local disk; a looser request would download a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

# ~5 minutes on 2 CPU cores: 90 s of training per model, the rest is set-up, evaluation and sampling
demo: $(STAMP)
	$(VENV)/bin/transnormer compare --presets t2-lm-tiny,vanilla-lm-tiny --data stdlib --budget 90s \
		--seq-len 256 --batch-size 8 --lr 2e-3 --warmup 30 --eval-batches 20 --out runs/demo --sample

bench: $(STAMP)
	$(PY) benchmarks/ops.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
