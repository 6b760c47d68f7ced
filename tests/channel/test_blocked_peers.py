"""Two live peers that each wait on their own send before receiving (neither ever
receives, so neither send completes) get the same typed error on every provider:
``Timeout`` after the deadline, never ``PeerLost`` (issue 29: on verbs this was
"PeerLost: no send completion for 10 s with the queue full" for a peer that was only
blocked). Both peers are processes of their own; after the Timeout each still
receives what the other managed to send, so the channel was alive all along.

``kind``: "eager", a batch larger than the peer's ring (``send_batch(timeout=)`` waits
for free slots), or "rendezvous", one message above the rendezvous threshold
(``send_batch`` returns, its handle's ``wait(timeout)`` waits for the receiver)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import rdmamw
from tests.channel.test_faults import ROOT
from tests.support.helpers import LISTEN_ADDRESS, reap, within

SLOTS, SLOT = 8, 4096
#: the deadline of each wait: past verbs' own "no send completion" check (10 s with the
#: send queue full, rdmamw/providers/verbs/_transport.pyx STUCK_NS), which is where a blocked peer
#: was reported lost; 1 s elsewhere
DEADLINE = {"verbs": 12.0}

#: one peer's part: send first, wait up to the deadline, then receive what the other sent
PEER = textwrap.dedent("""
    import json, time, rdmamw

    def blocked(ch, kind, deadline):
        batch = [b"e" * 4000] * 64 if kind == "eager" else [b"r" * (8 << 20)]
        t0, h, sent = time.monotonic(), None, 0
        try:
            h = ch.send_batch(batch, timeout=deadline)
            h.wait(deadline)
            out = {"error": None}
        except rdmamw.RdmamwError as e:
            out = {"error": type(e).__name__, "text": str(e)}
            sent = getattr(e, "sent", 0)
        out["seconds"] = time.monotonic() - t0
        # what the other side will receive: the whole batch once send_batch returned
        out["sent"] = len(batch) if h is not None else sent
        return out

    def drain(ch, n):
        got = 0
        while got < n:
            got += len(ch.recv_batch(timeout=30))
        return got
""")

CHILD = PEER + textwrap.dedent("""
    import sys
    ch = rdmamw.Channel.open(sys.argv[1], timeout=60, slots=%d, slot_size=%d)
    out = blocked(ch, sys.argv[2], float(sys.argv[3]))
    print(json.dumps(out), flush=True)
    theirs = int(sys.stdin.readline())
    out["received"] = drain(ch, theirs)
    print(json.dumps(out), flush=True)
    sys.stdin.readline()
    ch.close()
""") % (SLOTS, SLOT)

NS: dict = {}
exec(PEER, NS)      # the same code in this process: the other peer


@pytest.mark.parametrize("kind", ["eager", "rendezvous"])
def test_two_peers_blocked_in_their_sends_both_time_out(provider, kind):
    deadline = DEADLINE.get(provider, 1.0)
    with rdmamw.listen(LISTEN_ADDRESS[provider](), slots=SLOTS, slot_size=SLOT) as lst:
        p = subprocess.Popen([sys.executable, "-c", CHILD, lst.address, kind, str(deadline)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
        try:
            ch = lst.accept(timeout=60)
            mine = NS["blocked"](ch, kind, deadline)
            line = p.stdout.readline()
            assert line, p.communicate(timeout=30)
            theirs = json.loads(line)
            for who, r in (("here", mine), ("the other process", theirs)):
                assert r["error"] == "Timeout", (who, r)
                assert deadline - 0.1 < r["seconds"] < deadline + within(3.0), (who, r)
            # both alive: each takes what the other sent before its deadline
            p.stdin.write(f"{mine['sent']}\n")
            p.stdin.flush()
            got = NS["drain"](ch, theirs["sent"])
            after = json.loads(p.stdout.readline())
            assert (got, after["received"]) == (theirs["sent"], mine["sent"])
            p.stdin.write("bye\n")
            p.stdin.flush()
            p.wait(30)
            ch.close()
        finally:
            reap([p])
