"""An independent verbs peer: pyverbs + msgpack only, no rdmamw code.

It opens a channel to an rdmamw ``verbs://`` listener by following docs/protocol.md
(token proof, hello, endpoint descriptors, ready), then RDMA-WRITEs slots (SINGLE and PACKED, with
headers) and the arrival-bitmap word last in one chain, waits for the receiver's
reclaim write-back in its own block, and closes by setting the peer's CTRL.closed.

    pyverbs_sender.py HOST PORT NMSGS        prints "sent N", "reclaimed", "closed"
"""

import hashlib
import hmac
import os
import socket
import struct
import sys
import time

import msgpack

try:
    import pyverbs  # noqa: F401
except ImportError:
    sys.path.append("/usr/lib/python3/dist-packages")

import pyverbs.enums as e
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

DEV = os.environ.get("RXEVM_DEV", "rxe0")
GIDX = int(os.environ.get("RXEVM_GID_INDEX", "1"))
SLOTS, SLOT_SIZE = 4, 256           # the ring this peer "receives" on (never used)


# ---- docs/protocol.md: layout ---------------------------------------------------
def up(n, to):
    return (n + to - 1) // to * to


def bitmap_bytes(n):
    return up((n + 63) // 64 * 8, 64)


def stride(s):
    return 64 + up(s, 64)


def layout(my_slots, my_slot_size, peer_slots):
    arrival = 4096
    reclaim = arrival + bitmap_bytes(my_slots)
    ring = up(reclaim + bitmap_bytes(peer_slots), 4096)
    ring_len = my_slots * stride(my_slot_size)
    regions = [[0, 4096], [arrival, bitmap_bytes(my_slots)],
               [reclaim, bitmap_bytes(peer_slots)], [ring, ring_len]]
    return regions, up(ring + ring_len, 4096)


def header(seq, used, count, flags):
    return struct.pack("<QIHHII", seq, used, count, flags, ~seq & 0xFFFFFFFF, 0).ljust(64, b"\0")


# ---- framing ---------------------------------------------------------------------
def send(sock, obj):
    data = msgpack.packb(obj)
    sock.sendall(struct.pack("<I", len(data)) + data)


def recv(sock):
    (n,) = struct.unpack("<I", exact(sock, 4))
    return msgpack.unpackb(exact(sock, n))


def exact(sock, n):
    b = b""
    while len(b) < n:
        c = sock.recv(n - len(b))
        if not c:
            raise SystemExit("listener closed the connection")
        b += c
    return b


# ---- docs/protocol.md: the token proof (as for tcp) -------------------------------
def token():
    if os.environ.get("RDMAMW_TOKEN"):
        return os.environ["RDMAMW_TOKEN"].encode()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    with open(os.path.join(base, "rdmamw", "token"), "rb") as f:
        return f.read().strip()


def prove_token(sock):
    key = token()
    hello = exact(sock, 21)
    assert hello[:5] == b"RDMW\x01", hello
    nonce_l, nonce_o = hello[5:], os.urandom(16)
    mac = hmac.new(key, b"open" + nonce_l + nonce_o, hashlib.sha256).digest()
    sock.sendall(b"RDMW\x01" + nonce_o + mac)
    want = hmac.new(key, b"accept" + nonce_o + nonce_l, hashlib.sha256).digest()
    assert hmac.compare_digest(exact(sock, 32), want), "the listener does not know the token"


def main():
    host, port, nmsgs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sock = socket.create_connection((host, port), timeout=20)
    prove_token(sock)
    send(sock, {"v": 1, "slots": SLOTS, "slot_size": SLOT_SIZE, "mode": "batched",
                "pid": os.getpid()})
    hello = recv(sock)
    peer_slots, peer_slot_size = hello["slots"], hello["slot_size"]
    assert nmsgs + 3 <= peer_slots, "keep within one lap of the ring"
    my_regions, my_total = layout(SLOTS, SLOT_SIZE, peer_slots)
    peer_regions, peer_total = layout(peer_slots, peer_slot_size, SLOTS)

    ctx = Context(name=DEV)
    pattr = ctx.query_port(1)
    gid = ctx.query_gid(1, GIDX)
    pd = PD(ctx)
    cq = CQ(ctx, 256, None, None, 0)
    block = MR(pd, my_total, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE)
    src = MR(pd, 1 << 20, e.IBV_ACCESS_LOCAL_WRITE)
    cap = QPCap(max_send_wr=128, max_recv_wr=64, max_send_sge=1, max_recv_sge=1)
    init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)
    qattr = QPAttr(port_num=1)
    qattr.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE
    qp = QP(pd, init, qattr)
    for i in range(32):     # the rdmamw side may send zero-byte wake-ups
        qp.post_recv(RecvWR(wr_id=1000 + i, num_sge=1, sg=[SGE(src.buf + (1 << 19), 64, src.lkey)]))
    psn = int.from_bytes(os.urandom(3), "little")
    send(sock, {"v": 1, "qpn": qp.qp_num, "psn": psn,
                "gid": bytes.fromhex(str(gid).replace(":", "")), "lid": pattr.lid,
                "mtu": pattr.active_mtu, "addr": block.buf, "rkey": block.rkey,
                "len": my_total, "regions": my_regions, "event": False})
    d = recv(sock)
    assert d["v"] == 1 and d["len"] == peer_total and d["regions"] == peer_regions, d
    a = QPAttr(port_num=1)
    a.qp_access_flags = e.IBV_ACCESS_REMOTE_WRITE
    a.path_mtu = min(pattr.active_mtu, d["mtu"])
    a.dest_qp_num, a.rq_psn, a.sq_psn = d["qpn"], d["psn"], psn
    a.max_dest_rd_atomic = a.max_rd_atomic = 1
    a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
    dgid = GID(":".join(d["gid"][i:i + 2].hex() for i in range(0, 16, 2)))
    a.ah_attr = AHAttr(port_num=1, is_global=1, dlid=d["lid"],
                       gr=GlobalRoute(dgid=dgid, sgid_index=GIDX))
    qp.to_rts(a)
    send(sock, {"ready": True})
    assert recv(sock).get("ready") is True

    base = d["addr"]
    ring, arrival, ctrl = (base + peer_regions[3][0], base + peer_regions[1][0],
                           base + peer_regions[0][0])
    st = stride(peer_slot_size)
    wrs, off, slot = [], 0, 0

    def write(data, remote):
        nonlocal off
        src.write(data, len(data), off)
        w = SendWR(wr_id=len(wrs), opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                   sg=[SGE(src.buf + off, len(data), src.lkey)], send_flags=0)
        w.set_wr_rdma(d["rkey"], remote)
        wrs.append(w)
        off += up(len(data), 64)

    # nmsgs SINGLE slots, then one PACKED slot with three records
    for k in range(nmsgs):
        payload = b"pyverbs-%d" % k
        write(header(slot, len(payload), 1, 1) + payload, ring + slot * st)
        slot += 1
    recs = b"".join(struct.pack("<II", len(p), 0) + p.ljust(up(len(p), 8), b"\0")
                    for p in (b"packed-a", b"packed-bb", b""))
    write(header(slot, len(recs), 3, 2) + recs, ring + slot * st)
    slot += 1
    word = (1 << slot) - 1                  # phase 1: first use of slots 0..slot-1
    write(struct.pack("<Q", word), arrival)  # the arrival word last in the chain
    wrs[-1].send_flags = e.IBV_SEND_SIGNALED
    for i in range(len(wrs) - 1):
        wrs[i].next_wr = wrs[i + 1]
    qp.post_send(wrs[0])                     # one chain, one doorbell
    t0 = time.time()
    while True:
        n, wcs = cq.poll(16)
        done = [w for w in wcs if w.opcode == e.IBV_WC_RDMA_WRITE]
        assert all(w.status == 0 for w in wcs), [w.status for w in wcs]
        if done:
            break
        assert time.time() - t0 < 20, "no completion"
    print("sent", nmsgs + 3, flush=True)

    # the receiver writes its reclaim bits back into our RECLAIM region
    t0 = time.time()
    while int.from_bytes(block.read(8, my_regions[2][0]), "little") != word:
        assert time.time() - t0 < 20, "no reclaim write-back"
        time.sleep(0.01)
    print("reclaimed", flush=True)
    one = struct.pack("<Q", 1)
    src.write(one, 8, off)
    w = SendWR(wr_id=99, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
               sg=[SGE(src.buf + off, 8, src.lkey)], send_flags=e.IBV_SEND_SIGNALED)
    w.set_wr_rdma(d["rkey"], ctrl + 128)     # CTRL.closed
    qp.post_send(w)
    while not [x for x in cq.poll(16)[1] if x.wr_id == 99]:
        pass
    print("closed", flush=True)
    sock.close()


if __name__ == "__main__":
    main()
