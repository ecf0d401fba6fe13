# Rhizome — the two commands that matter: `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/rhizome/v1/*.proto)
GEN_STAMP := gen/.generated
PYTEST_ARGS ?=

.PHONY: install python-deps system-deps protos run demo demo-docker test test-unit test-chaos lint bench clean help

help:
	@echo "make install  - create .venv with pinned dependencies, generate gRPC stubs, apt-get docker.io, debootstrap and chromium (as root)"
	@echo "make run      - start the embedded platform (etcd, MongoDB-wire, Elasticsearch-API, daemon) in the foreground"
	@echo "make demo     - start the platform, train examples/mnist end to end, stop the platform"
	@echo "make demo-docker - the same with the learner in a container (docker backend; root or DOCKER_HOST)"
	@echo "make test     - lint + the whole test suite against real servers"
	@echo "make test-unit / test-chaos - the tests without servers / the chaos tests alone"
	@echo "make bench    - run every benchmark in benchmarks/"
	@echo "make clean    - remove .venv and generated code"

# The Debian packages (apt) and the virtualenv (pip) are made side by side: on a fresh
# machine each spends minutes downloading and unpacking, and neither needs the other.
install:
	@$(MAKE) --no-print-directory -j2 python-deps system-deps

python-deps: $(GEN_STAMP)
	@:

# The Docker engine (dockerd) and debootstrap (which builds the offline learner base image)
# are Debian packages, not wheels. Checked on every install because `command -v` costs
# nothing, while a stamp would go stale when someone removes the packages. Only root can
# apt-get; anyone else is told what to install and the rest of the install goes on (the
# local backend needs neither; the docker tests then fail saying how to provide an engine).
# chromium is the browser tests/browser/ drive (docs/dashboard.md); without it they fail
# saying how to install it.
SYSTEM_PKGS_CHECK = missing=""; \
	command -v dockerd >/dev/null 2>&1 || test -x /usr/sbin/dockerd || missing="$$missing docker.io"; \
	command -v debootstrap >/dev/null 2>&1 || test -x /usr/sbin/debootstrap || missing="$$missing debootstrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"

system-deps:
	@$(SYSTEM_PKGS_CHECK); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then \
		echo "note: not root, so not installing:$$missing. Run: sudo apt-get install$$missing (or set DOCKER_HOST to an engine you have)"; \
		exit 0; \
	fi; \
	echo "installing Debian packages:$$missing"; \
	if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing >/dev/null; }; then \
		echo "warning: apt-get could not install$$missing; the docker tests will fail until an engine is provided (or DOCKER_HOST is set)"; \
	fi

$(STAMP): requirements.txt setup.cfg pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	@printf "$(CURDIR)\n$(CURDIR)/gen\n" > $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rhizome-gen.pth
	@touch $@

protos: $(GEN_STAMP)

$(GEN_STAMP): $(PROTOS) $(STAMP)
	@rm -rf gen && mkdir -p gen
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=gen --pyi_out=gen --grpc_python_out=gen $(PROTOS)
	@touch gen/rhizome/__init__.py gen/rhizome/v1/__init__.py
	@touch $@

run: install
	$(BIN)/rhizome up --embedded --foreground

demo: install
	$(BIN)/python examples/demo.py

demo-docker: install
	$(BIN)/python examples/demo.py --backend docker

RUFF_PATHS := contract services learner tests benchmarks examples
MYPY_PATHS := contract services learner tests benchmarks

lint: install
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)
	$(BIN)/mypy $(MYPY_PATHS)

# The same lint, but mypy runs beside pytest instead of before it: from an empty cache (a
# fresh CI machine) it takes a core for about 45 s, while the suite spends most of its
# time waiting on the servers and learners it starts. Its report is printed after pytest's,
# and either failing fails `make test`. ruff takes seconds and still goes first.
test: install
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)
	@report=$$(mktemp); \
	$(BIN)/mypy $(MYPY_PATHS) >"$$report" 2>&1 & types=$$!; \
	$(BIN)/python -m pytest $(PYTEST_ARGS); tests=$$?; \
	wait $$types; typed=$$?; \
	echo "$(BIN)/mypy $(MYPY_PATHS)  (ran beside pytest)"; cat "$$report"; rm -f "$$report"; \
	test $$tests = 0 && test $$typed = 0

test-unit: install
	$(BIN)/python -m pytest -m "not integration and not chaos" $(PYTEST_ARGS)

test-chaos: install
	$(BIN)/python -m pytest tests/chaos $(PYTEST_ARGS)

bench: install
	@for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) gen .pytest_cache .mypy_cache .ruff_cache *.egg-info
