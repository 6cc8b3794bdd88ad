# Two set-up commands: `make demo` and `make test`. Both create .venv when it is
# missing and install the pinned dependencies (torch==2.13.0 is the CPU build); torchtune,
# whose release needs an older torchao than memplan's, goes to its own folder,
# .venv/torchtune (requirements-torchtune.lock says why); torchtitan with triton likewise
# to .venv/torchtitan (requirements-torchtitan.lock).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup clean browser gpu-check

$(STAMP): requirements.lock requirements-nodeps.lock requirements-torchtune.lock requirements-torchtitan.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.lock
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/torchtune -r requirements-torchtune.lock
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/torchtitan -r requirements-torchtitan.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/memplan demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

# The report's browser test needs Debian's chromium; install it when it is missing.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
		{ echo "installing Debian's chromium for the report's browser test"; \
		  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Two processes for the tests that run in one; the real gloo runs measure their ranks'
# peaks with the profiler, so they run after, on an otherwise idle machine.
test: $(STAMP) lint browser
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -n 2 -m "not gloo" --durations=30
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest -q -m gloo --durations=10

# GPU ground truth (benchmarks/gpu_check.py) on a machine with one NVIDIA GPU and nothing but
# this tree: no .venv is made and nothing installed (that machine has no network); it runs
# with .venv's Python where there is one, else python3, memplan from src/. DRY_RUN=1 needs
# no GPU (the cases and their estimates); QUICK=1 runs the quick subset; GPU_CHECK_ARGS
# passes more flags (--case NAME, --gpu NAME, ...). Results go to $GPU_CHECK_OUT (default
# memplan-out/gpu-check).
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-check:
	PYTHONPATH="$(CURDIR)/src:$(CURDIR)/tests/support$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_PYTHON) \
		benchmarks/gpu_check.py $(if $(DRY_RUN),--dry-run) $(if $(QUICK),--quick) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info memplan-out test-artifacts
