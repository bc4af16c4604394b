# thinvm: the two commands are `make demo` and `make test`; both set up
# everything they need first (Debian packages, venv, QEMU builds, images).
CACHE ?= $(HOME)/.cache/thinvm
VENV ?= $(CACHE)/venv
PY := $(VENV)/bin/python3
# Extra pytest options, e.g. PYTEST_ARGS=--junitxml=times.xml for every test's time.
PYTEST_ARGS ?=

.PHONY: setup demo test lint qemu image debs clean-cache

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/thinvm demo

test: setup
	$(PY) -m ruff check thinvm tests
	$(PY) -m mypy thinvm
	$(PY) -m pytest -ra -n 3 --dist loadfile --no-loadscope-reorder --durations=40 $(PYTEST_ARGS) tests

lint:
	$(PY) -m ruff check thinvm tests
	$(PY) -m ruff format --check thinvm tests
	$(PY) -m mypy thinvm

qemu:
	bash qemu/build.sh all

image:
	bash guest/image/build.sh --kernel 6.1 --balloon stock

# The Debian packages and their apt repository (docs/install.md); the
# set-up builds them too.
debs:
	bash packaging/build-debs.sh
