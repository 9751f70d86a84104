# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test venv clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch lies on disk; name it first so nothing pulls a CUDA build.
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q "$(TORCH)" -e ".[test]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/lightspeed demo

test: venv
	$(BIN)/python -m pytest -q -x tests

clean:
	rm -rf $(VENV)
