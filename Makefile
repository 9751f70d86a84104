# Two commands on a fresh machine: `make demo` and `make test`. Both build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

.PHONY: demo test venv clean chromium lint lightning-ref

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch lies on disk; name it first so nothing pulls a CUDA build.
	# --no-compile: no bytecode for the thousands of modules never imported (torch, transformers, ...);
	# Python writes it for those that are, on first import.
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)"
	$(BIN)/python -m pip install -q --no-compile "$(TORCH)" -e ".[test,trackers]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/lightspeed demo

# DeepSpeed JIT-compiles its CPU ops (about a minute each, once per environment, cached in
# ~/.cache/torch_extensions). Build them here, one process per op (each has its own build lock),
# beside the lint, so no test waits on a compile.
DS_OPS := CPUAdamBuilder ShareMemCommBuilder FusedAdamBuilder
LOAD_OP := import sys; from deepspeed.accelerator import get_accelerator as acc; \
	acc().create_op_builder(sys.argv[1]).load(); print("DeepSpeed op ready:", sys.argv[1])

# The report test renders report.html in headless Chromium (Debian's package). It is installed here when apt-get
# can (root, Debian); otherwise that one test is skipped with its reason and the rest runs.
chromium:
	@test -x /usr/bin/chromium || (command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
		|| echo "chromium not installed: tests/test_report.py skips its browser test")

# Real Lightning, for tests/test_lightning_ckpt.py (checkpoint files both ways), in a folder beside the
# venv's packages: `import lightning` must keep failing in the venv itself. Its other imports
# (torchmetrics, lightning-utilities, pyyaml, fsspec, tqdm, ...) are the venv's. Without a package
# index the install fails, and that test skips saying so.
LIGHTNING_REF := $(VENV)/lightning-ref
lightning-ref: venv
	@grep -qs "^2.6.6" $(LIGHTNING_REF)/lightning/version.info || $(BIN)/python -m pip install -q \
		--target $(LIGHTNING_REF) --no-deps lightning==2.6.6 || echo "lightning-ref not installed"

# pytest runs two workers, each one test file at a time (a file's module fixtures run once): most tests wait on
# rank start-up and rendezvous, so two streams fill the 2 cores that one stream leaves a third idle.
# The guards that measure: ruff (lint and format at 100 columns), pyright in basic mode over src/ (the
# Protocols checked by a machine; pyrightconfig.json), and the import DAG (tests/test_architecture.py).
lint: venv
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src
	$(BIN)/pyright

test: venv chromium lightning-ref
	@pids=""; for op in $(DS_OPS); do $(BIN)/python -c '$(LOAD_OP)' $$op & pids="$$pids $$!"; done; \
	$(MAKE) --no-print-directory lint; lint=$$?; built=0; \
	for p in $$pids; do wait $$p || built=1; done; test $$lint = 0 -a $$built = 0
	$(BIN)/python -m pytest -q -x -n 2 --dist loadfile --durations=25 tests

clean:
	rm -rf $(VENV)
