# cython: freethreading_compatible = False
"""Test-only hooks into the providers, kept out of their classes: drive a shm endpoint's
assisted READ/WRITE by hand and write the peer's shared records as a (hostile) peer
process can; feed tcp's frame decoder (rdmamw/providers/tcp/rm_tcp.h) a byte stream on its own
(the fuzz target) and READ through an endpoint; churn a verbs endpoint's exposure table
from several threads and put its queue pair in error; read a transport's region
addresses.
The package never imports this module (tests/test_layers.py checks); use it through
:mod:`rdmamw.testing`."""

import os
import socket
import threading

from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from rdmamw.providers.verbs._ibverbs cimport (
    IBV_QP_STATE,
    IBV_QPS_ERR,
    ibv_modify_qp,
    ibv_wc,
    ibv_mr,
    ibv_qp_attr,
    rm_ibv_load,
    rm_ibv_loaded,
)
from rdmamw.providers.shm._endpoint cimport RM_XNONE, RM_XTAB_N, rm_assist_publish
from rdmamw.providers.shm._transport cimport ShmTransport
from rdmamw.providers.tcp._transport cimport (
    RT_NREG,
    RT_UP,
    TcpTransport,
    pthread_mutex_destroy,
    pthread_mutex_init,
    rt_conn,
    rt_progress,
)
from rdmamw.providers.verbs._fence cimport chain_fences
from rdmamw.providers.verbs._qp cimport (
    FAIL_OTHER,
    FAIL_POST,
    FAIL_RECV_WC,
    FAIL_SEND_WC,
    FAIL_SOCKET,
    QP_CONNECTED,
    VerbsFailure,
)
from rdmamw.providers.verbs._transport cimport VerbsTransport
from rdmamw.providers.verbs._device cimport XMR_BUSY, VerbsDevice
from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_READ,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_BOUNDS,
    RM_NREGIONS,
    RM_WR_CMP_SWAP,
    RM_WR_EXPOSED,
    RM_WR_FENCE,
    RM_WR_FETCH_ADD,
    RM_WR_READ,
    RM_WR_SIGNALED,
    RM_WR_WRITE,
    now_ns,
    Transport,
    rm_mem,
    rm_wr,
)
from rdmamw.transport.atomics cimport (
    rm_cpu_relax,
    rm_load_acquire64,
    rm_spin_lock,
    rm_spin_unlock,
    rm_store_release64,
)

cdef extern from *:
    uint64_t hook_fetch_add "__atomic_fetch_add"(uint64_t *p, uint64_t v, int order) nogil
    int HOOK_SEQ_CST "__ATOMIC_SEQ_CST"

from rdmamw.providers.tcp._transport import _WHY
from rdmamw.providers.verbs._lib import load as _load_verbs


def region_address(Transport tp not None, int region):
    """Address of one of the transport's own regions (RM_REGION_*)."""
    if not 0 <= region < RM_NREGIONS:
        raise IndexError(region)
    return <size_t>tp.local[region].addr


# ---- shm ---------------------------------------------------------------------------

def expose_range(Transport tp not None, size_t addr, size_t length, bint writable=False):
    """Expose [addr, addr+length) to the peer (shm, tcp); the key."""
    cdef rm_mem m
    cdef int rc = tp.expose(addr, length,
                            RM_ACCESS_REMOTE_WRITE if writable else RM_ACCESS_REMOTE_READ, &m)
    if rc != 0:
        raise OSError(f"expose failed ({rc})")
    return m.rkey


def unexpose_range(Transport tp not None, uint32_t key):
    with nogil:
        tp.unexpose(key)


def offer_job(ShmTransport tp not None, size_t remote, size_t local, size_t length, size_t chunk,
              uint32_t key, uint32_t n, bint write=False):
    """Publish an assisted READ (WRITE) job with these fields, copying nothing; its seq."""
    tp.job_seq += 1
    rm_assist_publish(tp.job, tp.job_seq, write, remote, local, length, chunk, key, n)
    return tp.job_seq


def job_state(ShmTransport tp not None):
    """(fin, bad) of my job record."""
    return tp.job.fin, tp.job.bad


def job_claimed(ShmTransport tp not None):
    """Chunks of my current job claimed so far, by either side (a helper signalled
    while this is below the job's chunk count may hold one)."""
    return <uint32_t>(rm_load_acquire64(&tp.job.claim) & 0xFF)


def assist_now(ShmTransport tp not None):
    """Help with the peer's job now, as the engine does when idle; chunks done."""
    cdef int did
    with nogil:
        did = tp.assist()
    return did


def forge_peer_xtab(ShmTransport tp not None, uint32_t index, uint64_t addr, uint64_t length,
                    uint32_t key, uint32_t access):
    """Write an entry into the peer's exposure table as mapped here (index < 255)."""
    cdef uint64_t *e
    if tp.peer_xtab == NULL or index >= RM_XTAB_N:
        raise ValueError("no peer table or index out of range")
    e = <uint64_t *>(<char *>tp.peer_xtab + 32 + 32 * index)
    e[0], e[1], e[2] = addr, length, RM_XNONE
    (<uint32_t *>&e[3])[0] = key
    (<uint32_t *>&e[3])[1] = access


def hammer_job(ShmTransport tp not None, uint32_t seq, uint32_t n_ok, uint32_t n_bad,
               uint32_t next_bad, uint64_t iters):
    """Rewrite my job's claim word ``iters`` times, alternating the honest (seq, n_ok, 0)
    and a hostile (seq, n_bad, next_bad), without the GIL (run it in a thread)."""
    cdef uint64_t k, good = (<uint64_t>seq << 32) | (n_ok & 0xFF) << 8
    cdef uint64_t bad = (<uint64_t>seq << 32) | (n_bad & 0xFF) << 8 | (next_bad & 0xFF)
    cdef int _s
    with nogil:
        for k in range(iters):
            rm_store_release64(&tp.job.claim, good)
            for _s in range(<int>(k % 64)):
                rm_cpu_relax()
            rm_store_release64(&tp.job.claim, bad)
            for _s in range(<int>(k % 16)):
                rm_cpu_relax()


# ---- tcp ---------------------------------------------------------------------------

def read_remote(TcpTransport tp not None, uint32_t rkey, uint64_t off, uint32_t length) -> bytes:
    """READ ``length`` bytes at ``off`` of the peer's region ``rkey`` (tests and
    debugging; the engine will use READ for rendezvous)."""
    cdef rm_wr wr
    cdef int rc
    cdef char *buf = <char *>malloc(length or 1)
    if buf == NULL:
        raise MemoryError()
    tp.register_local(<size_t>buf, length)
    memset(&wr, 0, sizeof(wr))
    wr.local_addr = <uint64_t>buf
    wr.remote_off = off
    wr.length = length
    wr.rkey = rkey
    wr.opcode = RM_WR_READ
    wr.flags = RM_WR_SIGNALED
    try:
        with nogil:
            rc = tp.post(&wr, 1)
        if rc == RM_ERR_BOUNDS:
            raise ValueError("READ outside the peer's regions")
        if rc != 0:
            raise ConnectionError(f"READ failed ({rc}): {tp.error}")
        return buf[:length]
    finally:
        tp.nreg -= 1
        free(buf)


def apply_stream(bytes data, size_t region_bytes=4096, bint answer_reads=True) -> tuple:
    """Feed ``data`` as the byte stream of a connection to a progress thread whose
    four regions are ``region_bytes`` each, surrounded by guard bytes; return
    (frames applied, why it stopped, guards intact). For the fuzz tests: whatever
    the bytes, nothing outside the regions may change and nothing may crash.

    ``answer_reads=False`` is the fast mode of bench/fuzz_tcp.py: no helper threads
    (``data`` must fit the socket buffer), and the first READ_REQ that passes the
    bounds check ends the stream (its answer cannot be sent)."""
    cdef size_t guard = 4096
    cdef size_t total = 2 * guard + RT_NREG * region_bytes
    cdef char *mem = <char *>malloc(total)
    cdef rt_conn *c = <rt_conn *>calloc(1, sizeof(rt_conn))
    cdef int i
    cdef bint intact = True
    if mem == NULL or c == NULL:
        free(mem)
        free(c)
        raise MemoryError()
    memset(mem, 0xA5, total)
    a, b = socket.socketpair()
    evfd = os.eventfd(0, os.EFD_NONBLOCK)
    threads = []
    try:
        a.setblocking(False)
        pthread_mutex_init(&c.send_mu, NULL)
        pthread_mutex_init(&c.bl_mu, NULL)
        pthread_mutex_init(&c.rf_mu, NULL)
        for i in range(RT_NREG):
            c.addr[i] = mem + guard + i * region_bytes
            c.len[i] = region_bytes
            memset(c.addr[i], 0, region_bytes)
        c.pubbuf = <char *>malloc(region_bytes)
        c.pubcap = <uint32_t>region_bytes
        c.sock = a.fileno()
        c.evfd = evfd
        c.state = RT_UP
        c.timeout_ns = 2000000000
        if answer_reads:    # READ_REQ frames are answered: drain so nothing blocks
            threads = [threading.Thread(target=_drain, args=(b,), daemon=True),
                       threading.Thread(target=_feed, args=(b, data), daemon=True)]
            for t in threads:
                t.start()
        else:
            b.sendall(data)
            b.shutdown(socket.SHUT_WR)
            b.shutdown(socket.SHUT_RD)
        with nogil:
            rt_progress(c)
        for i in range(<int>guard):
            if <unsigned char>mem[i] != 0xA5 or <unsigned char>mem[total - 1 - i] != 0xA5:
                intact = False
                break
        return c.frames_rx, _WHY.get(c.why, c.why), intact
    finally:
        a.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join()
        a.close()
        b.close()
        os.close(evfd)
        pthread_mutex_destroy(&c.send_mu)
        pthread_mutex_destroy(&c.bl_mu)
        pthread_mutex_destroy(&c.rf_mu)
        free(c.pubbuf)
        free(c.bl)
        free(c)
        free(mem)


def _drain(sock) -> None:
    while sock.recv(65536):
        pass


def _feed(sock, data: bytes) -> None:
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass        # the decoder dropped the connection early: that is allowed


# ---- verbs -------------------------------------------------------------------------

def expose_churn(VerbsTransport tp not None, size_t addr, size_t length, int rounds):
    """Expose and unexpose [addr, addr+length) ``rounds`` times without the GIL and
    count the exposures whose table slot held another MR meanwhile (two threads at
    once must never share one; the engine's send and receive threads do this)."""
    cdef rm_mem m
    cdef int _r, clashes = 0
    cdef ibv_mr *mr
    _require_connected(tp)
    with nogil:
        for _r in range(rounds):
            if tp.expose(addr, length, RM_ACCESS_LOCAL, &m) != 0:
                clashes += 1
                continue
            rm_spin_lock(&tp.mem.xlock)
            mr = tp.mem.xmrs[m.handle - 1]
            if mr == NULL or mr == XMR_BUSY or mr.lkey != m.lkey:
                clashes += 1
            rm_spin_unlock(&tp.mem.xlock)
            tp.unexpose(m.handle)
    return clashes


def qp_error(VerbsTransport tp not None) -> None:
    """Move the QP to the error state behind the engine's back (fault tests)."""
    cdef ibv_qp_attr at
    cdef int rc
    _require_connected(tp)
    _load_ibverbs()
    memset(&at, 0, sizeof(at))
    at.qp_state = IBV_QPS_ERR
    rc = ibv_modify_qp(tp.qp, &at, IBV_QP_STATE)
    if rc != 0:
        raise OSError(rc, f"ibv_modify_qp to ERR failed: {os.strerror(rc)}")


def set_device_limit(VerbsDevice dev not None, str name, int n) -> int:
    """Make the device's limit ``name`` (max_mr or max_qp) read ``n`` (tests of the
    limits: no device has so few); the value it had."""
    if name == "max_mr":
        old, dev.max_mr = dev.max_mr, n
    elif name == "max_qp":
        old, dev.max_qp = dev.max_qp, n
    else:
        raise ValueError(f"no such device limit here: {name!r}")
    return old


def verbs_keys(VerbsTransport tp not None) -> tuple:
    """(the block's address, the key its peer was given for it, its MR's own key):
    with memory windows the two keys differ and only the first opens the block, and
    only through this endpoint's queue pair."""
    _require_connected(tp)
    return <uint64_t>tp.block.base, tp.block.head_rkey, tp.block.head_mr.rkey


def verbs_expose(VerbsTransport tp not None, size_t addr, size_t length,
                 bint writable=False, tuple cached=None) -> tuple:
    """Expose [addr, addr+length) to the peer as a rendezvous does: registered for it,
    or (``cached``: a handle of ``tp.mr_register``) inside a cached MR.
    ``(handle, key)`` for verbs_unexpose and the peer's verbs_remote."""
    cdef rm_mem m
    cdef int rc
    cdef uint32_t access = RM_ACCESS_REMOTE_WRITE if writable else RM_ACCESS_REMOTE_READ
    _require_connected(tp)
    if cached is None:
        rc = tp.expose(addr, length, access, &m)
    else:
        rc = tp.expose_cached(addr, length, access, cached[1], cached[2], &m)
    if rc != 0:
        raise OSError(f"expose failed ({rc})")
    return m.handle, m.rkey


def verbs_unexpose(VerbsTransport tp not None, uint32_t handle) -> None:
    tp.unexpose(handle)


def verbs_remote(VerbsTransport tp not None, uint32_t rkey, uint64_t addr,
                 object data, double timeout=20.0) -> tuple:
    """READ ``data`` bytes (an int) from, or WRITE ``data`` (bytes) to, the peer's
    ``addr`` under ``rkey``, as a peer that forges its own work requests can:
    ``(True, bytes read or b"")`` once it completed, ``(False, b"")`` if the peer's
    NIC refused it (the connection is then dead, as after any remote access error)."""
    cdef rm_wr wr
    cdef int rc
    cdef bint reading = isinstance(data, int)
    cdef uint32_t n = data if reading else len(data)
    cdef char *buf = <char *>calloc(n or 1, 1)
    cdef int64_t end
    if buf == NULL:
        raise MemoryError()
    _require_connected(tp)
    try:
        if not reading:
            memcpy(buf, <const char *>data, n)
        memset(&wr, 0, sizeof(wr))
        wr.wr_id = (<uint64_t>1) << 63       # an internal id: the engine never sees it
        wr.local_addr, wr.remote_off, wr.length = <uint64_t>buf, addr, n
        wr.lkey = tp.register_local(<size_t>buf, n or 1)
        wr.rkey = rkey
        wr.opcode = RM_WR_READ if reading else RM_WR_WRITE
        wr.flags = RM_WR_EXPOSED | RM_WR_SIGNALED
        with nogil:
            rc = tp.post(&wr, 1)
            end = now_ns() + <int64_t>(timeout * 1e9)
            rm_spin_lock(&tp.lock)
            while (rc == 0 and tp.state == QP_CONNECTED and tp.sq_done < tp.sq_posted
                   and now_ns() < end):
                if tp._poll_send_locked() == 0:
                    rm_cpu_relax()
            rm_spin_unlock(&tp.lock)
        if rc != 0 or tp.state != QP_CONNECTED:
            return False, b""
        if tp.sq_done < tp.sq_posted:
            raise TimeoutError("no completion for the forged work request")
        return True, (buf[:n] if reading else b"")
    finally:
        free(buf)


def verbs_side_socket(VerbsTransport tp not None) -> int:
    """The descriptor of the TCP side channel a verbs transport keeps (fault tests
    write stray bytes into it from the peer's end)."""
    _require_connected(tp)
    return tp.sock


def verbs_drain_then_wait(VerbsTransport tp not None, int timeout_ms) -> tuple:
    """Take the receive completions routed so far, as a drain between a waiter's last
    look and its sleep does (peer_state(), a post), then wait as a sleeper does:
    (how many the drain took, wait()'s return, seconds it took)."""
    cdef int taken, r
    cdef int64_t t0
    _require_connected(tp)
    with nogil:
        taken = tp._drain_recv()
        t0 = now_ns()
        r = tp.wait(timeout_ms)
    return taken, r, (now_ns() - t0) / 1e9


cdef _require_connected(VerbsTransport tp):
    if tp.qp == NULL or tp.state != QP_CONNECTED:
        raise ValueError("the verbs transport is not connected (or closed)")


cdef _load_ibverbs():
    """Fill this extension's own table of libibverbs calls (rm_ibverbs.h keeps one per
    extension) from the library the verbs provider loaded."""
    cdef char err[1024]
    if rm_ibv_loaded():
        return
    lib = _load_verbs()
    if rm_ibv_load(lib.encode(), err, sizeof(err)) != 0:
        raise OSError(2, f"cannot load {lib}: {err.decode(errors='replace')}")


def atomic_adds(size_t addr, uint64_t n) -> None:
    """Add 1 to the aligned 64-bit word at ``addr`` ``n`` times with the CPU's atomic
    instruction, without the GIL: an owner's own atomics on a word its peers update
    with fetch_add (each must be atomic with respect to the other)."""
    cdef uint64_t _i
    cdef uint64_t *word = <uint64_t *>addr
    if addr & 7:
        raise ValueError("an aligned 64-bit word")
    with nogil:
        for _i in range(n):
            hook_fetch_add(word, 1, HOOK_SEQ_CST)


def verbs_fences(str chain) -> str:
    """The WRs a verbs region chain fences (_fence.pxd): ``chain`` one letter a WR (R
    READ, W WRITE, A fetch_add, C compare_swap); the same letters, each fenced one in
    lower case."""
    cdef uint32_t i, n = len(chain)
    cdef rm_wr *wrs = <rm_wr *>calloc(n or 1, sizeof(rm_wr))
    codes = {"R": RM_WR_READ, "W": RM_WR_WRITE, "A": RM_WR_FETCH_ADD, "C": RM_WR_CMP_SWAP}
    if wrs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            wrs[i].opcode = codes[chain[i]]
            wrs[i].flags = RM_WR_EXPOSED
        chain_fences(wrs, n)
        out = []
        for i in range(n):
            out.append(chain[i].lower() if wrs[i].flags & RM_WR_FENCE else chain[i])
        return "".join(out)
    finally:
        free(wrs)


def verbs_first_cause(events) -> tuple:
    """What a fresh VerbsFailure keeps as a connection's first cause after ``events``
    in order: ("socket",) the side channel's EOF, ("post",) a failed post, ("other",)
    our own halt, ("send" | "recv", status, live) a failed work completion; (kind,
    status) with kind one of those names."""
    cdef VerbsFailure f = VerbsFailure()
    cdef ibv_wc wc
    for ev in events:
        if ev[0] in ("socket", "post", "other"):
            f.call({"socket": FAIL_SOCKET, "post": FAIL_POST, "other": FAIL_OTHER}[ev[0]], 0)
            continue
        memset(&wc, 0, sizeof(wc))
        wc.status = ev[1]
        f.completion(&wc, FAIL_SEND_WC if ev[0] == "send" else FAIL_RECV_WC, ev[2])
    names = {FAIL_SOCKET: "socket", FAIL_SEND_WC: "send", FAIL_RECV_WC: "recv",
             FAIL_POST: "post", FAIL_OTHER: "other"}
    return names.get(f.kind, f.kind), f.status
