#!/usr/bin/env bash
# `make test` after the set-up: the device half (scripts/test-device.sh: the soft-RoCE VM)
# runs in the background while the host half (pytest, then the shm and tcp soaks and
# the hostile soak) runs here. The host suite spends most of its time waiting on peers
# and deadlines, so the two overlap well on two cores (about 18 + 22 min one after the
# other, about 25 together).
# The VM's output goes to a log printed when it ends. Exit status: the first failure of
# host tests, soaks and device half, in that order.
set -uo pipefail
cd "$(dirname "$0")/.."
VPY=${1:-.venv/bin/python}
SOAK_SECONDS=${SOAK_SECONDS:-60}
t0=$(date +%s)
DEVLOG=$(mktemp -p . .device-log.XXXXXX)
# its own process group, so that an interrupted run takes the VM down with it
trap 'rm -f "$DEVLOG"; [ -n "${devpid:-}" ] && kill -- "-$devpid" 2>/dev/null' EXIT
SOAK_SECONDS=$SOAK_SECONDS setsid bash scripts/test-device.sh "$VPY" >"$DEVLOG" 2>&1 &
devpid=$!
echo "[test] device half started in the background (log printed at its end)"
"$VPY" -m pytest -q -p no:cacheprovider --durations=15
host=$?
soak=0
"$VPY" tests/soak/soak.py --provider shm --seconds "$SOAK_SECONDS" || soak=$?
"$VPY" tests/soak/soak.py --provider tcp --seconds "$SOAK_SECONDS" || soak=$?
# hostile clients against the listeners, the store and the parameter server (~20 s)
"$VPY" tests/soak/hostile_soak.py --seconds "${HOSTILE_SOAK_SECONDS:-10}" || soak=$?
# rank failures: random jobs lose a random rank (bench/chaos.py, ~55-80 s: no trial starts
# after 60 s); it prints its seed: `bench/chaos.py --replay SEED-INDEX` replays a trial.
# The collective and stream layers (the torch and ps ones start slower: by hand);
# kills, stops and closes, and dropped links between network namespaces where we may
# make them (root and iproute2)
CHAOS_FAULTS=kill,stop,close
if [ "$(id -u)" = 0 ] && command -v ip >/dev/null; then CHAOS_FAULTS=$CHAOS_FAULTS,drop; fi
"$VPY" bench/chaos.py --trials 8 --faults "$CHAOS_FAULTS" \
    --layers allreduce,bcast_gather,stream \
    --seed "${CHAOS_SEED:-$RANDOM}" --seconds 60 || soak=$?
echo "[test] host half done ($(( $(date +%s) - t0 )) s): pytest $host, soaks $soak; waiting for the device half"
wait "$devpid"
dev=$?
devpid=
echo "---- device half (scripts/test-device.sh) ----"
cat "$DEVLOG"
echo "---- end of the device half: exit $dev ----"
echo "[test] all done in $(( $(date +%s) - t0 )) s: pytest $host, soaks $soak, device $dev"
for rc in "$host" "$soak" "$dev"; do
  if [ "$rc" != 0 ]; then exit "$rc"; fi
done
