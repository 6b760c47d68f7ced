"""Two ranks over verbs where rank 1's copy of rank 0's descriptor says another GID
(``tamper``) or not (``honest``): rank 1 reports what Channel.open(0) did and which
queue pairs and memory registrations its process holds afterwards (``rdma res``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import rdmamw


def resources(kind: str) -> list[dict]:
    """This process's entries of ``rdma -j res show KIND`` (qp, mr)."""
    out = subprocess.run(["rdma", "-j", "res", "show", kind], capture_output=True,
                         text=True, check=True, timeout=30).stdout
    return [e for e in json.loads(out or "[]") if e.get("pid") == os.getpid()]


def main() -> None:
    tamper = sys.argv[1] == "tamper"
    w = rdmamw.init(timeout=60)
    out: dict = {"rank": w.rank}
    if w.rank == 1:
        if tamper:      # the same network (consistent), another address: 10.77.0.1 -> .9
            port = w.peers[0]["verbs"]["ports"][0]
            port["gid"] = port["gid"][:15] + bytes([port["gid"][15] ^ 8])
        try:
            ch = rdmamw.Channel.open(0, timeout=20)
            out["opened"] = ch.provider
            ch.send(b"hi")
            ch.recv(timeout=20)
        except rdmamw.ProtocolError as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["qps"] = [e.get("state") for e in resources("qp")]
        out["mrs"] = len(resources("mr"))
        print(json.dumps(out), flush=True)
        if "opened" in out:
            ch.close()
    else:
        try:
            ch = rdmamw.Channel.open(1, timeout=15 if tamper else 30)
            ch.send(bytes(ch.recv(timeout=20)))
            out["opened"] = ch.provider
        except (rdmamw.Timeout, rdmamw.PeerLost) as e:     # (rank 1 gone: PeerLost)
            out["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out), flush=True)
    rdmamw.finalize()


if __name__ == "__main__":
    main()
