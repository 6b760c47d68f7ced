#!/usr/bin/env bash
# The device half of `make test`: the tests marked `device` (the channel suite on
# verbs, the pyverbs peer, verbs faults) inside the soft-RoCE VM of scripts/rxe-vm.sh.
# The extension is built on the host (seconds) and run in the guest (TCG is slow).
# Exit status: the guest pytest's (125 = the VM itself failed). RDMAMW_VM=0 skips.
# RDMAMW_DEVICE_MARK: which device tests (default "device and not slow"; `make
# test-slow` runs "device and slow").
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=${1:-.venv/bin/python}
if [ "${RDMAMW_VM:-1}" = 0 ]; then
  echo "[test-device] RDMAMW_VM=0: device tests not run"; exit 0
fi
bash scripts/rxe-vm.sh --deps
# an old build without the verbs extension? build it now
if ! "$VPY" -c "import rdmamw.providers.verbs._transport" 2>/dev/null; then
  "$VPY" setup.py -q build_ext --inplace >/dev/null
fi
# the test-only hooks (not in the package): built in place in tests/support
if ! "$VPY" -c "import tests.support._hooks" 2>/dev/null; then
  "$VPY" tests/support/build_hooks.py >/dev/null
fi
bash scripts/pyverbs-link.sh "$VPY"
t0=$(date +%s)
# the guest writes its results here (the current directory is shared with the VM)
JUNIT=$(mktemp -p . .device-junit.XXXXXX.xml)
# the demo's data split, made here: sklearn takes minutes to import under TCG
DIGITS=$(mktemp -p . .device-digits.XXXXXX.npz); trap 'rm -f "$JUNIT" "$DIGITS"' EXIT
"$VPY" -c "import sys; from rdmamw.apps.demo import mlp; mlp.load(seed=0).save(sys.argv[1])" \
  "$DIGITS" 2>/dev/null || rm -f "$DIGITS"
# the VM's bound: the device tests take about 1,500 s under TCG alone (1,690 s beside the
# host half in CI), and the soak comes after them inside the same VM; on a slower machine
# beside the host half they passed 2,700 s (2026-12-07) and once took 2,869 s: a slow VM
# is not a failure (CI's 90 minutes still hold the set-up, lint and docs before it)
export RXEVM_TIMEOUT=${RXEVM_TIMEOUT:-3900}
# the device tests, then the soak on verbs (tests/soak/soak.py; smaller messages: TCG is slow).
# A killed peer must be seen lost within 6 s here, not the 2 s of the host soaks: under
# TCG, with the host half of the CI on the same 2 cores, the kernel's teardown of the
# killed process (its QPs, MRs and pinned pages go before its socket closes) and our
# wake-up take 0.16 s median, up to 1.8 s and once 2.95 s (CI of stop 37); still below
# the 10 s after which a sender calls a silent peer stuck, so a death seen only that way
# (or never) fails. Verbose (-v): each test's name and outcome as it ends, so a failure
# is named even when the VM's bound cuts the run before pytest's summary. A test's default
# bound is 360 s here, not pytest's 120 s (pyproject.toml): under TCG a channel test that
# starts Python children takes 45-90 s beside the host half, and CI's machine ran the
# device half 1.8 times slower than this one (a 60 s test hit 120 s in CI on 2026-12-07); a
# test's own timeout mark still wins, and its inner deadlines stay below the bound.
scripts/rxe-vm.sh "DEVICE_TEST_DIGITS=$DIGITS RDMAMW_TEST_PROVIDERS=verbs $VPY -m pytest -v -p no:cacheprovider -m '${RDMAMW_DEVICE_MARK:-device and not slow}' -rs --timeout ${RDMAMW_DEVICE_TIMEOUT:-360} --junitxml=$JUNIT ${RDMAMW_DEVICE_PYTEST_ARGS:-} \
  && $VPY tests/soak/soak.py --provider verbs --seconds ${SOAK_SECONDS:-60} --peers 2 --threads 1 --max-size 262144 --lost-within 6"
# all skipped is not passed: some device test must have run and passed
passed=$("$VPY" scripts/junit_passed.py --slowest 15 "$JUNIT")
if [ "$passed" -lt 1 ]; then
  echo "[test-device] FAILED: no device test passed in the VM (all skipped?)" >&2; exit 1
fi
echo "[test-device] $passed device tests and the verbs soak passed in the VM ($(( $(date +%s) - t0 )) s)"
