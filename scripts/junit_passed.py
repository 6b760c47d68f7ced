"""Print how many test cases passed in a pytest --junitxml file (neither failed,
errored nor skipped): test-device.sh refuses a device run in which none did."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def passed(path: str) -> int:
    cases = ET.parse(path).getroot().iter("testcase")
    return sum(1 for c in cases
               if not any(c.find(t) is not None for t in ("failure", "error", "skipped")))


if __name__ == "__main__":
    print(passed(sys.argv[1]))
