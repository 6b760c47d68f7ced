"""Ring vs rhd vs hierarchical allreduce across two "hosts" joined by a slow link:
4 ranks alternate between two network namespaces (shm inside, tcp across) whose veth
link tbf limits to --rate. Every ring step crosses the link, hierarchical sends each
byte across once per direction (3x less at 4 ranks). Prints each algorithm's best of
--reps seconds, the cost model's prediction and its automatic choice.

    sudo python bench/allreduce_two_hosts.py [--length 1048576] [--reps 5] [--rate 200mbit]

Needs root, iproute2 and tc. Speed comparisons live here, not in the unit tests
(tests/integrations/test_collectives.py checks the results and the choice, not the times)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from rdmamw.collectives import policy  # noqa: E402
from tests.integrations.test_bootstrap import clean_env  # noqa: E402
from tests.support.helpers import reap  # noqa: E402
from tests.support.netns import shape_link, two_namespaces  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "support", "coll_worker.py")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=1 << 20, help="float32 elements")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rate", default="200mbit")
    a = ap.parse_args()
    with two_namespaces() as (hosts, devs):
        shape_link(devs, a.rate)
        first, second = sorted(hosts)
        cfg = json.dumps({"topology": "probe", "length": a.length, "reps": a.reps})
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, WORKER, "race", cfg],
            env=clean_env(RANK=str(r), WORLD_SIZE="4", RDMAMW_TCP_PEER_TIMEOUT="10",
                          MASTER_ADDR=hosts[first], MASTER_PORT=str(28000 + os.getpid() % 1000),
                          RDMAMW_COLL_CONFIG=os.path.join(ROOT, "tests", "no-such-config.json")),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            for r, ns in enumerate([first, second, first, second])]
        try:
            outs = [p.communicate(timeout=600) for p in procs]
        finally:
            reap(procs)
    if any(p.returncode for p in procs):
        sys.exit("\n".join(err[-2000:] for _, err in outs))
    res = json.loads(outs[0][0].splitlines()[0])
    nbytes = 4 * a.length
    print(f"groups {res['groups']}, {nbytes} bytes, link {a.rate}")
    predicted = policy.explain(nbytes, res["groups"], policy.Model())
    for alg, s in sorted(res["best"].items(), key=lambda kv: kv[1]):
        print(f"  {alg:13s} best {s * 1e3:8.1f} ms   model {predicted.get(alg, 0) * 1e3:8.1f} ms")
    print(f"automatic choice: {res['auto']}")


if __name__ == "__main__":
    main()
