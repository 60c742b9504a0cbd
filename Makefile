# Everything installs from nothing into .venv. TORCH overrides the torch requirement
# (the default pins the release whose CPU wheel is on this project's machines).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test cute-check lint docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)  # the Muse Glimmer train = rollout counts, then every op through dispatch
	$(BIN)/python -m opcontract.demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/contract-lint
	$(BIN)/python -m pytest -q

cute-check: $(STAMP)  # the CuTe DSL kernels compile for sm_90a (no GPU needed; ~260 MB install)
	$(BIN)/python -m pip install -q -e ".[cute]"
	$(BIN)/python -m pytest -q tests/test_cute_compile.py

lint: $(STAMP)
	$(BIN)/contract-lint

docs: $(STAMP)
	$(BIN)/opcontract-docs docs/ops

clean:
	rm -rf $(VENV) build *.egg-info
