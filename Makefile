# Two entry points for a fresh machine: `make demo` and `make test`.
# torch is pinned here (a CPU wheel of exactly this version is on the build machines);
# the package itself only asks for torch>=2.9 so users bring their own build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: venv demo test lint bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/lrmoe compare --config configs/demo.toml --out runs/demo --overwrite

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
