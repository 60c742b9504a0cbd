# Everything installs from nothing into .venv. TORCH overrides the torch requirement
# (the default pins the release whose CPU wheel is on this project's machines).
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint docs clean

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

lint: $(STAMP)
	$(BIN)/contract-lint

docs: $(STAMP)
	$(BIN)/opcontract-docs docs/ops

clean:
	rm -rf $(VENV) build *.egg-info
