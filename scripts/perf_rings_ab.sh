#!/usr/bin/env bash
# rdmamw perf over verbs with whole rings (RDMAMW_VERBS_RING_START=0) and growing ones
# (the default), alternating, three rounds; run inside the soft-RoCE VM:
#   scripts/rxe-vm.sh 'bash scripts/perf_rings_ab.sh'
# Each run is a fresh server and client process, so each pays for its ring's growth.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
P=${PYTHON:-.venv/bin/python}
one() {   # ring_start, client args...
  local rs=$1; shift
  RDMAMW_VERBS_RING_START=$rs $P -m rdmamw.cli perf --server 127.0.0.1 >/dev/null 2>&1 &
  local srv=$!
  RDMAMW_VERBS_RING_START=$rs timeout 300 $P -m rdmamw.cli perf 127.0.0.1 "$@" 2>&1 \
    | grep -E "^ *[0-9]+ +[0-9]+ "
  wait $srv 2>/dev/null
}
for round in 1 2 3; do
  for rs in 0 65536; do
    echo "== round $round ring_start $rs rate";  one $rs -t rate -s 8 -n 20000
    echo "== round $round ring_start $rs bw64K"; one $rs -t bw -s 64K -n 1000
    echo "== round $round ring_start $rs bw4M";  one $rs -t bw -s 4M -n 60
  done
done
