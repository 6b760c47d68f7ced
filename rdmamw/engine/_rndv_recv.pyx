# cython: freethreading_compatible = False
"""Rendezvous, receiving side: a descriptor record names a message the sender exposed
(we READ it into the buffer the user gave, posted, or a new one) or WROTE into the
destination we advertised; then its done bit flips (docs/protocol.md). The descriptor
is copied out of the ring once and checked before it is used."""

cimport cython
from cpython.bytearray cimport PyByteArray_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.ref cimport Py_XINCREF, PyObject
from libc.stdint cimport uint8_t
from libc.stdlib cimport free
from libc.string cimport memcmp, memcpy, memset

from rdmamw.engine._frames cimport (
    CTRL_ADVERT,
    DESC_BYTES,
    DESC_READ,
    DESC_WRITTEN,
    REC_RNDV,
    RM_MAX_WR_BYTES,
    RM_NO_SLOT,
    RM_RNDV_WRID,
    RNDV_N,
    WAIT_READ,
)
from rdmamw.engine._eager_recv cimport put_len
from rdmamw.engine._leases cimport end_lease, take_lease
from rdmamw.engine._link cimport fill_wr, slice_end
from rdmamw.engine._messages cimport new_dest, new_message
from rdmamw.engine._trace cimport TR_RNDV_RECV, rm_trace_on, rm_trace_put
from rdmamw.transport._base cimport (
    RM_ACCESS_LOCAL,
    RM_ACCESS_REMOTE_WRITE,
    RM_ERR_AGAIN,
    RM_ERR_BOUNDS,
    RM_ERR_CLOSED,
    RM_ERR_PEER_LOST,
    RM_ERR_UNSUPPORTED,
    RM_REGION_CTRL,
    RM_WR_EXPOSED,
    RM_WR_READ,
    RM_WR_SIGNALED,
    now_ns,
    rm_wr,
)
import collections

from rdmamw.errors import (
    BufferTooSmall,
    ChannelClosed,
    MessageLost,
    MessageTooLarge,
    PeerLost,
    ProtocolError,
    Timeout,
)

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

cdef extern from "unistd.h" nogil:
    int usleep(unsigned int usec)

cdef int64_t CLOSE_END_NS = 8000000000  # a READ cut by a close waits this long at most
                                        # for the transport to go (close()'s own bounds)



def fresh_buffer(Py_ssize_t n):
    """The destination of a message when nobody gave an allocator: an uninitialised
    bytearray (a Channel passes its pool's instead)."""
    return PyByteArray_FromStringAndSize(NULL, n)


@cython.final
cdef class Posted:
    """A destination posted for rendezvous message ``index`` (and, with "write", its
    exposure, advertised to the sender)."""


@cython.final
cdef class RndvReceiver:
    """The rendezvous messages of one direction as they are taken."""

    def __cinit__(self, Link link, EagerReceiver rx, bint write, uint64_t max_msg,
                  Waiter w):
        cdef void *mem = NULL
        self.link, self.rx, self.write, self.max_msg, self.w = link, rx, write, max_msg, w
        self.posted = collections.deque()
        self.allocate = fresh_buffer
        if posix_memalign(&mem, 64, RNDV_N * 32) != 0:
            raise MemoryError()
        self.advsrc = <uint64_t *>mem
        memset(self.advsrc, 0, RNDV_N * 32)
        self.lkey_adv = link.register_local(<size_t>self.advsrc, RNDV_N * 32)

    def __dealloc__(self):
        if self.rd_want and self.rd_dst is not None:
            # dropped with a READ in flight: its destination must outlive the transport
            # (tcp's progress thread may still write into it), so it is leaked
            Py_XINCREF(<PyObject *>self.rd_dst)
        free(self.advsrc)

    cdef int use(self, object regcache_dst, object allocate) except -1:
        """The channel's registration cache of destinations (None: not registered)
        and the allocator of destinations nobody posted or gave."""
        self.regcache_dst, self.allocate = regcache_dst, allocate
        return 0

    cdef Py_ssize_t deliver_into(self, Dest into) except -2:
        """recv_into: the next message, eager (copied out of the ring) or rendezvous,
        into ``into``: its length, or -1 if none has arrived. recv_many_into (``into``
        has lengths): the eager messages at the head that fit, back to back, or a
        rendezvous message at the head alone; how many."""
        cdef EagerReceiver rx = self.rx
        cdef char *base
        cdef uint32_t L, fl, slot
        cdef uint64_t n
        if not rx.peek(&base, &L, &fl):
            return -1
        if fl == REC_RNDV:
            self.receive(base, into)
            n = self.last_len
        else:
            if L > <uint64_t>into.view.len:
                raise BufferTooSmall(f"the next message is {L} bytes; the buffer holds "
                                     f"{into.view.len}", needed=L)
            if into.nlens:
                return rx.copy_many(<char *>into.view.buf, <size_t>into.view.len,
                                    into.lens.buf, into.wide, into.nlens)
            memcpy(into.view.buf, base, L)
            n = L
        slot = rx.cur_slot
        rx.advance(L, n)
        rx.release_one(slot)
        if into.nlens:
            put_len(into.lens.buf, into.wide, 0, n)
            return 1
        return <Py_ssize_t>n

    cdef Message take(self, Endpoint eng, char *base):
        """recv / recv_batch: the rendezvous message described at ``base`` (peeked)
        received (receive()), as a Message of ``eng`` viewing its destination; the
        descriptor's record consumed and released."""
        cdef Dest dst = self.receive(base, None)
        cdef uint32_t slot = self.rx.cur_slot
        cdef Message m = new_message(eng, <char *>dst.view.buf, <Py_ssize_t>self.last_len,
                                     RM_NO_SLOT, dst)
        self.rx.advance(DESC_BYTES, self.last_len)
        self.rx.release_one(slot)
        return m

    cdef Dest receive(self, char *base, Dest into):
        """Bring the rendezvous message described at ``base`` into ``into``, its posted
        destination, or a new one; flip its done bit. On any error nothing is
        consumed: the message stays receivable (or the channel is broken), except a
        message above max_msg, which is refused (see _refuse)."""
        cdef rm_desc d
        cdef Dest dst, posted = None
        cdef Posted pr = None
        cdef int64_t t0 = now_ns() if rm_trace_on(self.link.trace) else 0
        memcpy(&d, base, DESC_BYTES)    # read once: the peer may rewrite the slot
        self._check_desc(&d)
        if self.posted and (<Posted>self.posted[0]).index == d.index:
            pr = self.posted[0]
            posted = pr.dest
        if d.length > self.max_msg:
            self._refuse(&d, posted)
        if d.kind == DESC_WRITTEN and (pr is None or not pr.advertised
                                       or <uint64_t>posted.view.len < d.length):
            self.link.fail(f"rendezvous {d.index} claims to be written into a destination "
                           f"this side did not advertise (or that is too small)")
        if into is not None and posted is not None:
            raise ValueError(f"rendezvous message {d.index} goes to the buffer posted "
                             f"for it with post_recv; receive it with recv/recv_batch")
        try:
            if self.rd_want:
                dst = self._resume_read(&d, into, posted)
            else:
                dst = into if into is not None else posted
                if dst is None:
                    dst = new_dest(self.allocate(d.length))
                self._check_room(dst, posted, &d)
                if d.kind == DESC_READ:
                    self._read_into(dst, &d, into is not None)
                    self.link.cnt.rndv_reads += 1
        except MessageLost:
            self._skip(&d, posted)
            raise
        if posted is not None:
            self.drop_posted()
        self.link.cnt.rndv_recv += 1
        self.link.cnt.rndv_bytes_recv += d.length
        self.last_len = d.length
        self._consumed(&d)
        if t0:
            rm_trace_put(self.link.trace, TR_RNDV_RECV, self.link.serial, t0, now_ns(), d.index,
                         d.length, 0, d.kind == DESC_WRITTEN)
        return dst

    cdef int _check_room(self, Dest dst, Dest posted, rm_desc *d) except -1:
        """BufferTooSmall (the message stays) unless ``dst`` holds the message."""
        if <uint64_t>dst.view.len < d.length:
            if dst is posted:           # hand the posted buffer back; the message stays
                self.drop_posted()
            raise BufferTooSmall(f"the next message is {d.length} bytes; the "
                                 f"{'posted ' if dst is posted else ''}buffer holds "
                                 f"{dst.view.len}", needed=d.length)
        return 0

    cdef void _consumed(self, rm_desc *d) noexcept:
        """Message ``d.index`` is taken out of the stream: flip its done bit (the sender
        may release its source)."""
        self.next += 1
        self.rx.flip_done(d.entry)

    cdef int _refuse(self, rm_desc *d, Dest posted) except -1:
        """A message above max_msg: consume its record without allocating or reading
        anything, tell the sender it is done with it, raise MessageTooLarge once. The
        channel goes on with the next message."""
        self._skip(d, posted)
        self.link.cnt.rndv_refused += 1
        raise MessageTooLarge(f"the peer sent rendezvous message {d.index} of {d.length} "
                              f"bytes; this channel takes at most {self.max_msg} bytes "
                              f"(max_message_size / RDMAMW_MAX_MESSAGE_SIZE): it was "
                              f"refused unread; the next message follows")

    cdef int _skip(self, rm_desc *d, Dest posted) except -1:
        """Take message ``d`` out of the stream unread (refused or lost): its record
        is consumed, its done bit flips, the next message follows."""
        cdef uint32_t slot = self.rx.cur_slot
        if posted is not None:
            self.drop_posted()
        self._consumed(d)
        self.rx.advance(DESC_BYTES, 0)
        self.rx.release_one(slot)
        if not self.link.closed and not self.link.peer_gone \
                and self.link.peer_status() == 0:
            self.rx.flush()
        return 0

    cdef int _check_desc(self, rm_desc *d) except -1:
        if d.kind != DESC_READ and d.kind != DESC_WRITTEN:
            self.link.fail(f"rendezvous descriptor of unknown kind {d.kind}")
        if d.index != self.next or d.entry != d.index % RNDV_N:
            self.link.fail(f"rendezvous descriptor {d.index} (entry {d.entry}); expected "
                           f"{self.next}")
        if d.length == 0 or d.length > RM_MAX_WR_BYTES:
            self.link.fail(f"rendezvous descriptor of {d.length} bytes")
        return 0

    cdef int _read_into(self, Dest dst, rm_desc *d, bint user) except -1:
        """READ the described message into ``dst``: through a cached registration of
        its owner when the transport registers memory (a pooled or reused buffer is then
        registered once), else exposed for this READ only. On an asynchronous READ that
        outlives the receive's deadline, Timeout: the READ stays in flight (rd_*) and
        the next receive call finishes it (_resume_read)."""
        cdef Link link = self.link
        cdef int rc
        cdef rm_mem mem
        cdef rm_wr wr
        cdef bint wait = not link.synchronous() or link.async_read()
        cdef bint registered = False
        lease = None
        mem.handle = 0
        mem.lkey = 0
        if self.regcache_dst is not None:
            try:
                lease = take_lease(self.regcache_dst, dst.obj, self.link.closed)
            except MessageTooLarge as e:
                raise ProtocolError(f"cannot register the destination of rendezvous "
                                    f"message {d.index}: {e.__cause__}") from e
            mem.lkey = lease.handle[1]
            registered = True
        wr.wr_id = RM_RNDV_WRID | (d.index + 1)
        wr.local_addr = <uint64_t>dst.view.buf
        wr.remote_off = d.addr
        wr.length = <uint32_t>d.length
        wr.rkey = d.key
        wr.opcode = RM_WR_READ
        wr.flags = RM_WR_EXPOSED | RM_WR_SIGNALED if wait else RM_WR_EXPOSED
        wr.imm = 0
        with nogil:
            rc = 0 if registered else link.expose(wr.local_addr, d.length, RM_ACCESS_LOCAL, &mem)
            if rc == 0:
                wr.lkey = mem.lkey
                rc = link.post(&wr, 1)
        if rc != 0 or not wait:
            link.unexpose(mem.handle)
            if lease is not None:
                end_lease(lease)
            if rc != 0:
                self._raise_read(rc, d)
            return 0
        self.rd_dst, self.rd_lease, self.rd_mem = dst, lease, mem
        self.rd_desc, self.rd_want, self.rd_user = d[0], d.index + 1, user
        return self._wait_read()

    cdef Dest _resume_read(self, rm_desc *d, Dest into, Dest posted):
        """Finish the READ an earlier receive left in flight; the message lands where
        this call says (copied there if that is not where it was being read)."""
        cdef Dest src = self.rd_dst, dst
        if memcmp(d, &self.rd_desc, DESC_BYTES) != 0:
            self.link.fail(f"the peer rewrote rendezvous descriptor {d.index} while it was "
                           f"being read")
        dst = into if into is not None else posted
        if dst is None and not self.rd_user:
            dst = src
        if dst is not None:
            self._check_room(dst, posted, d)
        self._wait_read()
        self.link.cnt.rndv_reads += 1
        if dst is None:
            dst = new_dest(self.allocate(d.length))
        if dst.view.buf != src.view.buf:
            memcpy(dst.view.buf, src.view.buf, d.length)
        return dst

    cdef int _wait_read(self) except -1:
        """Wait for the READ in flight until the receive's deadline (Timeout: it stays
        in flight), in the endpoint's one wait loop, a slice at a time (signals); then
        end it. A close of this side cuts it short (_cut)."""
        cdef int r, rc, status
        cdef uint64_t done
        cdef int64_t deadline = self.rx_until
        cdef rm_desc d = self.rd_desc
        cdef bint first = True
        while True:
            with nogil:
                r = self.w.wait(WAIT_READ, self.rd_want, slice_end(deadline), first)
            first = False
            if r == 1:
                self.link.read_result(&done, &status)
                # IBV_WC_REM_INV_REQ_ERR / REM_ACCESS_ERR: outside the peer's MR
                rc = 0 if status == 0 else (RM_ERR_BOUNDS if status in (9, 10)
                                            else RM_ERR_PEER_LOST)
                break
            if r < 0:
                rc = r
                break
            if self.link.closed:
                return self._cut(deadline)
            if deadline and now_ns() >= deadline:
                raise Timeout(f"rendezvous message {d.index} ({d.length} bytes) is still "
                              f"being read; receive again to finish it (nothing is lost)")
            PyErr_CheckSignals()
        self.end_read()
        if rc != 0:
            self._raise_read(rc, &d)
        return 0

    cdef int _cut(self, int64_t deadline) except -1:
        """This side's close() cut the READ in flight short: the message is lost and
        its destination is never presented as data. The READ ends when the transport
        goes (close() does that within its bounds): wait for it, or the deadline, so the
        destination is no longer written when this returns (else close() ends it)."""
        cdef rm_desc d = self.rd_desc
        cdef int64_t until = now_ns() + CLOSE_END_NS
        if deadline and deadline < until:
            until = deadline
        with nogil:
            while not self.link.ended and now_ns() < until:
                usleep(1000)
        if self.link.ended:
            self.end_read()
        raise ChannelClosed(f"this side closed the channel while rendezvous message "
                            f"{d.index} ({d.length} bytes) was being read; it was not "
                            f"received")

    cdef int end_read(self) except -1:
        """The READ in flight is over (or the transport closed): give back its exposure
        and lease."""
        cdef object lease = self.rd_lease
        if self.rd_want == 0:
            return 0
        self.link.unexpose(self.rd_mem.handle)
        self.rd_mem.handle = 0
        self.rd_lease = None
        self.rd_dst = None
        self.rd_want = 0
        if lease is not None:
            end_lease(lease)
        return 0

    cdef int _raise_read(self, int rc, rm_desc *d) except -1:
        cdef Link link = self.link
        cdef int st = link.peer_status()
        if link.closed:
            raise ChannelClosed(f"this side closed the channel while rendezvous message "
                                f"{d.index} was being read; it was not received")
        if st == RM_ERR_CLOSED:
            # the peer closed (cleanly) and gave its source back before we read it
            raise MessageLost(f"the peer closed the channel before rendezvous message "
                              f"{d.index} ({d.length} bytes) was read; that message is "
                              f"lost, the messages after it follow")
        if rc == RM_ERR_BOUNDS:
            with nogil:
                st = link.peer_dying()
            if st == RM_ERR_PEER_LOST:
                rc = st     # its memory went with it: not the peer's lie, its death
        if rc == RM_ERR_BOUNDS:
            link.fail(f"rendezvous descriptor {d.index} ({d.length} bytes at {d.addr:#x}, "
                      f"key {d.key:#x}) is outside what the sender exposed; nothing read")
        st = link.peer_status()
        if st < 0 or rc == RM_ERR_PEER_LOST:
            link.mark_lost()
            raise PeerLost(link.lost(f"peer lost while reading rendezvous message {d.index}"))
        raise ProtocolError(f"the rendezvous READ of message {d.index} failed ({rc})")

    cdef int drop_all(self) except -1:
        """close(): what the receiving side holds goes (the transport is closed:
        nothing writes into a READ destination any more): posted destinations, a READ
        left in flight."""
        while self.posted:
            self.drop_posted()
        return self.end_read()

    cdef void drop_posted(self) noexcept:
        cdef Posted p = self.posted.popleft()
        if p.advertised:
            self.link.unexpose(p.adv.handle)
            p.advertised = False

    cdef int post(self, Dest d) except -1:
        """Post ``d`` as the destination of the next rendezvous message without one;
        with "write", expose it and advertise it to the sender (caller holds the
        receive lock)."""
        cdef Link link = self.link
        cdef uint8_t e
        cdef int rc
        cdef rm_wr wr[2]
        cdef Posted p = Posted.__new__(Posted)
        if len(self.posted) >= RNDV_N:
            raise ValueError(f"at most {RNDV_N} destinations may be posted ahead")
        p.dest = d
        p.index = self.next + len(self.posted)
        if self.write and d.view.len:
            rc = link.expose(<uint64_t>d.view.buf, d.view.len, RM_ACCESS_REMOTE_WRITE, &p.adv)
            if rc == 0:
                p.advertised = True
                e = <uint8_t>(p.index % RNDV_N)
                self.advsrc[4 * e] = <uint64_t>d.view.buf
                self.advsrc[4 * e + 1] = <uint64_t>d.view.len
                self.advsrc[4 * e + 2] = p.adv.rkey
                self.advsrc[4 * e + 3] = p.index + 1     # the tag, written last
                fill_wr(&wr[0], &self.advsrc[4 * e], self.lkey_adv, RM_REGION_CTRL,
                        (CTRL_ADVERT + 4 * e) * 8, 24)
                fill_wr(&wr[1], &self.advsrc[4 * e + 3], self.lkey_adv, RM_REGION_CTRL,
                        (CTRL_ADVERT + 4 * e + 3) * 8, 8)
                link.lock()
                rc = link.post(wr, 2)
                link.unlock()
                if rc != 0:
                    link.unexpose(p.adv.handle)
                    link.raise_post(rc)
            elif rc != RM_ERR_UNSUPPORTED and rc != RM_ERR_AGAIN:
                link.raise_post(rc)
        self.posted.append(p)
        return 0
