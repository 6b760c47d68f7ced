#!/usr/bin/env bash
# rdmamw perf over verbs with one setting at two values, alternating, three rounds
# (the same session, so both see the same machine); run inside the soft-RoCE VM:
#   scripts/rxe-vm.sh 'bash scripts/perf_ab.sh RDMAMW_VERBS_RING_START 0 65536'
#   scripts/rxe-vm.sh 'bash scripts/perf_ab.sh RDMAMW_VERBS_WINDOWS 0 1'
# Each run is a fresh server and client process with default arguments otherwise, so
# each pays for what its setting costs at set-up (a ring's growth, a window's bind).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
P=${PYTHON:-.venv/bin/python}
NAME=$1 A=$2 B=$3
one() {   # value, client args...
  local v=$1; shift
  env "$NAME=$v" $P -m rdmamw.cli perf --server 127.0.0.1 >/dev/null 2>&1 &
  local srv=$!
  env "$NAME=$v" timeout 300 $P -m rdmamw.cli perf 127.0.0.1 "$@" 2>&1 \
    | grep -E "^ *[0-9]+ +[0-9]+ "
  wait $srv 2>/dev/null
}
for round in 1 2 3; do
  for v in "$A" "$B"; do
    echo "== round $round $NAME=$v rate";  one "$v" -t rate -s 8 -n 20000
    echo "== round $round $NAME=$v bw64K"; one "$v" -t bw -s 64K -n 1000
    echo "== round $round $NAME=$v bw4M";  one "$v" -t bw -s 4M -n 60
  done
done
