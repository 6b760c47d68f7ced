"""The device premise of one protection domain per process (issue 28 item 1, the plan in
docs/protocol.md "Keys a peer gets"): with every peer's QP in one PD, an
MR with remote access would be open to all of them, so the memory a peer may touch is
given through a type-2 memory window bound to that peer's QP. Checked here with pyverbs
alone, on the device of the soft-RoCE VM: the bound QP's peer READs the window, a QP of
the same PD connected to someone else is refused, and so is the MR's own key (an MR
registered without remote access)."""

from __future__ import annotations

import ctypes
import os
import time

import pytest

from rdmamw.providers.verbs import _device
from tests.channel.test_channel_basic import recv_all
from tests.support import hooks
from tests.support.helpers import NO_DEVICE, VERBS_OK

pytestmark = [pytest.mark.device, pytest.mark.skipif(not VERBS_OK, reason=NO_DEVICE)]

REMOTE_ACCESS_ERROR = 10        # IBV_WC_REM_ACCESS_ERR
SECRET = b"only-the-bound-peer-reads-this"


def test_a_type_2_window_opens_memory_to_one_qp_of_a_shared_pd():
    pytest.importorskip("pyverbs.device", reason="python3-pyverbs is not linked into the venv")
    import pyverbs.enums as e
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR, MW, MWBindInfo
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    ctx = Context(name=os.environ.get("RXEVM_DEV", "rxe0"))
    attr = ctx.query_device()
    if not attr.device_cap_flags & e.IBV_DEVICE_MEM_WINDOW_TYPE_2B:
        pytest.skip("the device has no type-2 memory windows")
    gidx = int(os.environ.get("RXEVM_GID_INDEX", "1"))
    port, gid = ctx.query_port(1), ctx.query_gid(1, gidx)
    pd = PD(ctx)
    cq = CQ(ctx, 64, None, None, 0)
    acc = e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_LOCAL_WRITE

    def qp():
        cap = QPCap(max_send_wr=16, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
        a = QPAttr(port_num=1)
        a.qp_access_flags = acc
        return QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap), a)

    def connect(q, other):
        a = QPAttr(port_num=1)
        a.qp_access_flags = acc
        a.path_mtu = port.active_mtu
        a.dest_qp_num, a.rq_psn, a.sq_psn = other.qp_num, 0, 0
        a.max_dest_rd_atomic = a.max_rd_atomic = 1
        a.min_rnr_timer, a.timeout, a.retry_cnt, a.rnr_retry = 12, 14, 7, 7
        a.ah_attr = AHAttr(port_num=1, is_global=1, dlid=port.lid,
                           gr=GlobalRoute(dgid=gid, sgid_index=gidx))
        q.to_rts(a)

    def pair():
        x, y = qp(), qp()
        connect(x, y)
        connect(y, x)
        return x, y

    def status(wr_id):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 20:
            for wc in cq.poll(8)[1]:
                if wc.wr_id == wr_id:
                    return wc.status
        raise AssertionError(f"no completion for work request {wr_id}")

    dst = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE)

    def read(q, rkey, addr, wr_id):
        dst.write(b"\0" * len(SECRET), len(SECRET), 0)
        w = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_READ, num_sge=1,
                   sg=[SGE(dst.buf, len(SECRET), dst.lkey)])
        w.set_wr_rdma(rkey, addr)
        q.post_send(w)
        return status(wr_id), dst.read(len(SECRET), 0)

    # every QP stays referenced: a destroyed responder would answer nothing at all
    peer, mine = pair()                 # the peer's QP and ours: the window is the peer's
    stranger, strangers_peer = pair()   # another peer's QP, in the same PD
    third, thirds_peer = pair()
    mem = MR(pd, 4096, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_MW_BIND)
    mem.write(SECRET, len(SECRET), 0)
    mw = MW(pd, e.IBV_MW_TYPE_2)
    bind = SendWR(wr_id=1, opcode=e.IBV_WR_BIND_MW, num_sge=0)
    bind.set_bind_wr(mw, MWBindInfo(mem, mem.buf, 4096, e.IBV_ACCESS_REMOTE_READ))
    try:
        mine.post_send(bind)
        assert status(1) == 0
        rkey = bind.rkey    # the key the bind made (pyverbs increments mw.rkey's tag)
        assert read(peer, rkey, mem.buf, 2) == (0, SECRET)
        assert read(stranger, rkey, mem.buf, 3) == (REMOTE_ACCESS_ERROR, b"\0" * len(SECRET))
        assert read(third, mem.rkey, mem.buf, 4) == (REMOTE_ACCESS_ERROR, b"\0" * len(SECRET))
    finally:
        mw.close()          # first: an MR with a window bound to it cannot be deregistered


# ---- the provider's own keys (RDMAMW_VERBS_WINDOWS, on by default) -----------------

def _pair(opts: str = ""):
    from tests.providers.test_verbs import _pair as pair
    return pair(opts)


def _device_windows() -> int:
    return sum(d.counters()["mws"] for d in _device.devices())


def test_the_block_opens_only_with_the_window_key_the_peer_was_given():
    """A peer that forges a WRITE into our block with the MR's own key (what it would
    get without windows) is refused by the NIC; the window key it was given works."""
    a, b, lst, ta, tb = _pair()
    try:
        a.send(b"through the window").wait(timeout=10)
        assert recv_all(b, 1) == [b"through the window"]
        _, key, mr_key = hooks.verbs_keys(tb)
        assert key != mr_key
        end = hooks.region_address(tb, 0) + 8 * 160     # a control word nothing uses
        assert hooks.verbs_remote(ta, key, end, b"windowed") == (True, b"")
        assert ctypes.string_at(end, 8) == b"windowed"
        assert hooks.verbs_remote(ta, mr_key, end, b"by-mr-ky") == (False, b"")
        assert ctypes.string_at(end, 8) == b"windowed"
    finally:
        a.close(), b.close(), lst.close()


@pytest.mark.parametrize("cached", [False, True], ids=["exposed", "cached"])
def test_an_exposure_s_key_dies_with_it(cached):
    """A rendezvous source is readable by the peer while exposed, and never after:
    also a buffer the registration cache keeps registered (without windows its MR's
    key stayed valid as long as the cache held it)."""
    a, b, lst, ta, tb = _pair()
    buf = ctypes.create_string_buffer(SECRET * 100, 4096)
    addr = ctypes.addressof(buf)
    windows = _device_windows()
    handle = tb.mr_register(addr, 4096, remote_read=True) if cached else None
    try:
        h, key = hooks.verbs_expose(tb, addr, 4096, cached=handle)
        assert _device_windows() == windows + 1
        assert hooks.verbs_remote(ta, key, addr, 4096) == (True, buf.raw[:4096])
        hooks.verbs_unexpose(tb, h)
        assert _device_windows() == windows
        assert hooks.verbs_remote(ta, key, addr, 4096) == (False, b"")
    finally:
        if handle is not None:
            tb.mr_deregister(handle)
        a.close(), b.close(), lst.close()
    if not cached:
        return
    a, b, lst, ta, tb = _pair()     # the cached MR's own key opens nothing either
    handle = tb.mr_register(addr, 4096, remote_read=True)
    try:
        assert hooks.verbs_remote(ta, handle[2], addr, 64) == (False, b"")
    finally:
        tb.mr_deregister(handle)
        a.close(), b.close(), lst.close()


@pytest.mark.parametrize("windows", [0, 1])
def test_both_settings_carry_eager_and_rendezvous_messages(windows):
    """RDMAMW_VERBS_WINDOWS=0 (or a device without type-2 windows) hands out the MRs'
    own keys; either way every message arrives whole."""
    import numpy as np
    a, b, lst, ta, tb = _pair(f"?windows={windows}")
    try:
        _, key, mr_key = hooks.verbs_keys(tb)
        assert (key == mr_key) == (not windows)
        big = np.arange(1 << 20, dtype=np.uint32)       # 4 MiB: rendezvous
        h = a.send_batch([b"small", big])
        got = recv_all(b, 2, timeout=30)
        h.wait(timeout=30)
        assert bytes(got[0]) == b"small"
        assert np.array_equal(np.frombuffer(got[1], dtype=np.uint32), big)
        binds = a.stats()["mw_binds"] + b.stats()["mw_binds"]
        assert (binds > 0) == bool(windows)
    finally:
        a.close(), b.close(), lst.close()


def test_a_window_is_refused_on_another_peer_s_queue_pair_of_the_same_pd():
    """Two channels of this process share its protection domain: what one channel
    exposed to its peer cannot be READ by the other channel's peer with the same key
    (the window is bound to the first channel's queue pair); the first peer can."""
    first, second = _pair(), _pair()
    assert _verbs_dev_pds() == 1
    buf = ctypes.create_string_buffer(SECRET * 100, 4096)
    addr = ctypes.addressof(buf)
    try:
        h, key = hooks.verbs_expose(first[4], addr, 4096)
        assert hooks.verbs_remote(second[3], key, addr, 64) == (False, b"")
        assert hooks.verbs_remote(first[3], key, addr, 64) == (True, buf.raw[:64])
        hooks.verbs_unexpose(first[4], h)
    finally:
        for a, b, lst, *_ in (first, second):
            a.close(), b.close(), lst.close()


def _verbs_dev_pds() -> int:
    import gc
    gc.collect()        # earlier tests' endpoints without windows had a PD each
    return sum(d.counters()["pds"] for d in _device.devices())
