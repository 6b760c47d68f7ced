# The two commands of the README: `make demo` and `make test`. Both create .venv,
# install the package (building the Cython extensions) and then do their job.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SOURCES := $(shell find rdmamw -name '*.pyx' -o -name '*.pxd' -o -name '*.h') setup.py pyproject.toml \
	tests/support/_hooks.pyx tests/support/build_hooks.py

.PHONY: demo test test-fast test-slow test-torch soak chaos vm-deps bench instructions bench-allreduce bench-rndv bench-rndv-verbs bench-rmem bench-tcp \
	bench-verbs fuzz-tcp mutate mutate-c lint build docs plots clean

$(VPY):
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip

# then the test-only hooks, built in place in tests/support: never part of the package
$(STAMP): $(VPY) $(SOURCES)
	$(VPY) -m pip install --quiet "Cython>=3.0.10,<3.4" "setuptools>=68" wheel
	$(VPY) -m pip install --quiet --no-build-isolation -e ".[test,dev,examples]"
	$(VPY) tests/support/build_hooks.py
	touch $(STAMP)

build: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rdmamw demo

# The device tests (marked `device`) skip on the host and run in a soft-RoCE VM
# (scripts/test-device.sh; RDMAMW_VM=0 leaves them out), in the background while the host
# suite and the soaks run (scripts/test-all.sh). The apt packages come first
# (rdma-core and pyverbs for the VM; the verbs extension itself needs no header).
test: vm-deps $(STAMP)
	bash scripts/setup_test_deps.sh
	bash scripts/setup_torch.sh $(VPY)
	bash scripts/setup_ray.sh $(VPY)
	$(VPY) -m ruff check .
	SOAK_SECONDS=$(SOAK_SECONDS) bash scripts/test-all.sh $(VPY)

# the fast lane (CI runs it before `make test`): the unit tests and the channel suite on
# shm alone (tests/unit, tests/channel), a couple of minutes; docs/testing.md
test-fast: $(STAMP)
	RDMAMW_TEST_PROVIDERS=shm $(VPY) -m pytest -q -p no:cacheprovider --durations=5 \
		tests/unit tests/channel

# the randomized soak (tests/soak/soak.py, docs/benchmarks/soaks.md): 60 s per provider in `make
# test` (verbs inside the VM); `make soak SOAK_SECONDS=1800 SOAK_PROVIDER=tcp` for a long run
SOAK_SECONDS ?= 60
SOAK_PROVIDER ?= shm
soak: $(STAMP)
	$(VPY) tests/soak/soak.py --provider $(SOAK_PROVIDER) --seconds $(SOAK_SECONDS) $(SOAK_ARGS)

# the chaos test of rank failures (bench/chaos.py, docs/testing.md): 8 trials in `make test`;
# `make chaos CHAOS_TRIALS=1000 CHAOS_ARGS="--seed 7"` for a long run (about 2 hours)
CHAOS_TRIALS ?= 100
chaos: $(STAMP)
	$(VPY) bench/chaos.py --trials $(CHAOS_TRIALS) $(CHAOS_ARGS)

vm-deps:
	@if [ "$${RDMAMW_VM:-1}" != 0 ]; then bash scripts/rxe-vm.sh --deps; fi

test-slow: vm-deps $(STAMP)
	$(VPY) -m pytest -q -p no:cacheprovider -m slow --timeout 900
	RDMAMW_DEVICE_MARK="device and slow" SOAK_SECONDS=10 bash scripts/test-device.sh $(VPY)

bench: $(STAMP)
	bash bench/setup.sh $(VPY)
	$(VPY) bench/run.py

# torch's own distributed test suite (DistributedTest, tests/support/torch_suite.py) at world
# sizes 2 and 3: gloo's run, then rdmamw's, both counts side by side; fails on a test
# gloo passes and rdmamw does not unless docs/torch.md says why it cannot apply
test-torch: $(STAMP)
	bash scripts/setup_torch.sh $(VPY)
	$(VPY) -m pip install --quiet "expecttest>=0.2"
	$(VPY) tests/support/torch_suite.py --compare --world-size 2
	$(VPY) tests/support/torch_suite.py --compare --world-size 3

# instructions per 8 B message at batch 1 and by send()/recv() (valgrind's callgrind,
# bench/instructions.py, ~60 s): fails when they exceed bench/instructions_baseline.json
# by more than 1 %;
# `bench/instructions.py --record` updates the baseline, deliberately. Also in test-slow.
instructions: $(STAMP)
	$(VPY) bench/instructions.py --check
	$(VPY) bench/instructions.py --check --batch one

# allreduce 1 MiB / 64 MiB at 2 and 4 ranks against mpi4py, gloo and the numpy.add floor
bench-allreduce: $(STAMP)
	bash bench/setup.sh $(VPY)
	$(VPY) bench/allreduce_bench.py --wait-quiet 30

# large messages: rendezvous per strategy against memcpy and mpi4py; registration cost
bench-rndv: $(STAMP)
	bash bench/setup.sh $(VPY)
	$(VPY) bench/rendezvous_bench.py --wait-quiet 60 --rounds 2 $(BENCH_ARGS)

# registration cost with real ibv_reg_mr (soft-RoCE in the VM), with and without the cache
bench-rndv-verbs: vm-deps $(STAMP)
	bash scripts/rxe-vm.sh "$(VPY) bench/rendezvous_bench.py --provider verbs --only regcost $(BENCH_ARGS)"

# one-sided read/write against np.copyto, ucx_perftest, NIXL (shm) and Mooncake (tcp);
# bench/setup.sh puts the Python peers in .venv-peers (docs/benchmarks/remote-memory.md)
bench-rmem: $(STAMP)
	bash bench/setup.sh $(VPY)
	$(VPY) bench/rmem_bench.py $(BENCH_ARGS)

# tcp against iperf3 / pyzmq / raw sockets, and the long decoder fuzz run (not in CI)
bench-tcp: $(STAMP)
	bash scripts/setup_test_deps.sh
	$(VPY) -m pip install --quiet "pyzmq>=25"
	$(VPY) bench/tcp_bench.py

fuzz-tcp: $(STAMP)
	$(VPY) bench/fuzz_tcp.py

# batched vs ack on verbs (soft-RoCE in the VM): ratios, not absolute speed
bench-verbs: vm-deps $(STAMP)
	bash scripts/rxe-vm.sh "$(VPY) bench/verbs_rxe.py $(BENCH_ARGS)"

# mutation testing (docs/testing.md; not in `make test`: an hour on 2 cores): mutmut's
# mutants of the pure-Python layers, each module against its own tests, within a budget
# (MUTATE_MODULES=ps/server.py,sched/ MUTATE_BUDGET=seconds-per-module MUTATE_JOBS=2
# MUTATE_MAX=N MUTATE_SEED=N; fails when a module scores under 85 % or a C mutant lives), then the hand-made C/Cython mutants
mutate: $(STAMP)
	$(VPY) -m pip install --quiet "mutmut>=3.8,<4"
	$(VPY) scripts/mutate.py --jobs $(MUTATE_JOBS)
	$(VPY) scripts/c_mutants.py
MUTATE_JOBS ?= 2

mutate-c: $(STAMP)
	$(VPY) scripts/c_mutants.py

# ruff; cython-lint on the .pyx/.pxd files (it runs pycodestyle from the venv's bin);
# mypy on rdmamw/ (pyproject.toml's [tool.mypy]: strict for the public API); stubtest
# on the extensions' .pyi stubs against the modules just built (docs/testing.md)
CYTHON_SOURCES = $(shell find rdmamw tests/support -name '*.pyx' -o -name '*.pxd')
lint: $(STAMP)
	$(VPY) -m ruff check .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/cython-lint $(CYTHON_SOURCES)
	$(VPY) -m mypy
	$(VPY) scripts/stubtest.py

# the docs site (mkdocs.yml, nav = docs/index.md's reading order; the API reference from
# the docstrings, the Cython classes read from the built package): strict, so a broken
# link, anchor or reference fails; into site/. The docs extra of pyproject.toml first.
docs: $(STAMP)
	$(VPY) -m pip install --quiet $$($(VPY) -c 'import tomllib; \
		print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))')
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

# the plots of docs/benchmarks/ from docs/benchmarks/figures.json (matplotlib: the examples extra)
plots: $(STAMP)
	$(VPY) bench/plots.py

clean:
	rm -rf build site $(VENV) .mypy_cache rdmamw/*.c rdmamw/*/*.c rdmamw/*.so rdmamw/*/*.so *.egg-info \
		tests/support/_hooks.c tests/support/*.so
