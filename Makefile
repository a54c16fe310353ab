# `make run` and `make test` set everything up on a fresh machine: a .venv with the project installed.
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --editable '.[dev]'
	touch $@

.PHONY: run test
run: $(VENV)/.installed
	$(PY) -m harness +net=resnet50 +strategy=vanilla

test: $(VENV)/.installed
	$(PY) -m pytest
