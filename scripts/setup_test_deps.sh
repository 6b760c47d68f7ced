#!/usr/bin/env bash
# System packages the tcp/bootstrap tests and bench/tcp_bench.py use: MPICH (a job
# started by mpirun), iproute2 (network namespaces as hosts), iperf3 (the loopback
# limit of the benchmark), prometheus (the server that scrapes a job's metrics in
# tests/integrations/test_metrics_job.py) and tmux (the terminal `rdmamw top` is tested in,
# tests/integrations/test_top.py). Idempotent; without root it only says what is missing and
# the tests that need it skip with a reason.
set -euo pipefail
want=(mpich iproute2 iperf3 prometheus tmux)
missing=()
for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "setup_test_deps: missing ${missing[*]} (need root + apt); those tests will skip" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null 2>&1 || {
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}
echo "setup_test_deps: installed ${missing[*]}"
