"""Print how many test cases passed in a pytest --junitxml file (neither failed,
errored nor skipped): test-device.sh refuses a device run in which none did. With
``--slowest N`` also list the N slowest cases on stderr, so a CI log shows where the
VM's time went."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET


def passed(path: str) -> int:
    cases = ET.parse(path).getroot().iter("testcase")
    return sum(1 for c in cases
               if not any(c.find(t) is not None for t in ("failure", "error", "skipped")))


def slowest(path: str, n: int) -> list[tuple[float, str]]:
    cases = ET.parse(path).getroot().iter("testcase")
    times = [(float(c.get("time", 0)), f"{c.get('classname')}::{c.get('name')}") for c in cases]
    return sorted(times, reverse=True)[:n]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("junit")
    ap.add_argument("--slowest", type=int, default=0, metavar="N")
    a = ap.parse_args()
    for t, name in slowest(a.junit, a.slowest):
        print(f"{t:8.1f} s  {name}", file=sys.stderr)
    print(passed(a.junit))
