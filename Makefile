# The two commands of the README: `make demo` and `make test`. Both create .venv,
# install the package (building the Cython extensions) and then do their job.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := $(shell find rdmamw -name '*.pyx' -o -name '*.pxd' -o -name '*.h') setup.py pyproject.toml

.PHONY: demo test test-slow bench bench-tcp fuzz-tcp lint build clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip

$(STAMP): $(VPY) $(SOURCES)
	$(VPY) -m pip install --quiet "Cython>=3.0.10,<3.4" "setuptools>=68" wheel
	$(VPY) -m pip install --quiet --no-build-isolation -e ".[test,dev]"
	touch $(STAMP)

build: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rdmamw demo

test: $(STAMP)
	bash scripts/setup_test_deps.sh
	$(VPY) -m ruff check .
	$(VPY) -m pytest -q -p no:cacheprovider

test-slow: $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider -m slow --timeout 900

bench: $(STAMP)
	bash bench/setup.sh $(VPY)
	$(VPY) bench/run.py

# tcp against iperf3 / pyzmq / raw sockets, and the long decoder fuzz run (not in CI)
bench-tcp: $(STAMP)
	bash scripts/setup_test_deps.sh
	$(VPY) -m pip install --quiet "pyzmq>=25"
	$(VPY) bench/tcp_bench.py

fuzz-tcp: $(STAMP)
	$(VPY) bench/fuzz_tcp.py

lint: $(STAMP)
	$(VPY) -m ruff check .

clean:
	rm -rf build $(VENV) rdmamw/*.c rdmamw/*/*.c rdmamw/*.so rdmamw/*/*.so *.egg-info
