# cython: freethreading_compatible = False
"""The ``verbs`` provider's block (declared in _block.pxd): one endpoint's control
words, bitmaps and the ring the peer writes, registered on its VerbsMemory, and the
ring that grows both ways (docs/protocol.md "Rings that grow"). The transport posts
the grant words and wakes the peer (_transport.pyx)."""

import cython

from libc.errno cimport errno
from libc.stdint cimport uint32_t, uint64_t
from libc.stdlib cimport free
from libc.string cimport memset
from posix.mman cimport MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, PROT_READ, PROT_WRITE, mmap, munmap
from posix.stdlib cimport posix_memalign

from rdmamw.transport.atomics cimport rm_load_acquire64, rm_spin_trylock, rm_spin_unlock
from rdmamw.providers.verbs._ibverbs cimport *
from rdmamw.providers.verbs._memory cimport VerbsMemory, pin_charge, pin_refund
from rdmamw.providers.verbs._memory import budget_error


@cython.final
@cython.no_gc_clear     # release() deregisters through mem (before the PD goes)
cdef class VerbsBlock:
    """One endpoint's block (control words, bitmaps, the ring the peer writes) and its
    registrations, and a ring that grows both ways (docs/protocol.md "Rings that
    grow"): the parts of my ring registered and granted to the peer, and the parts of
    the peer's ring it granted me. The transport posts the grant words and wakes the
    peer; this unit owns what the words say and the registrations behind them."""

    def __cinit__(self, VerbsMemory mem not None, uint64_t length, uint64_t off,
                  uint64_t ring_len, uint64_t stride, uint32_t granted):
        cdef void *p = NULL
        cdef uint64_t head = length
        cdef int err
        self.mem, self.length = mem, length
        # zero pages on demand: the part of a ring never granted costs no memory
        p = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if p == MAP_FAILED:
            raise MemoryError()
        self.base = <char *>p
        if stride and granted and ring_len % stride == 0 and granted < ring_len // stride:
            self.on = True      # the header and the first slots now, the rest on demand
            self.slots, self.stride, self.off = ring_len // stride, stride, off
            self.granted = granted
            head = off + <uint64_t>granted * stride
        if pin_charge(head):
            raise budget_error(head, "a channel's receive ring")
        self.charged = head
        # the peer writes the block and may read it back (all of it is what the peer
        # wrote, but the region chain words it READs: verbs/_regions.pyx); no atomics
        self.head_mr = mem.dev.reg_mr(mem.pd, p, head, mem.remote_flags(
            IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ))
        if self.head_mr == NULL:
            err = errno
            raise mem.dev.mr_failed(err, "a channel's receive block", head)
        self.head_rkey = self.head_mr.rkey
        if not self.on:
            return
        p = NULL
        if posix_memalign(&p, 64, MAX_PARTS * 8) != 0:
            raise MemoryError()
        memset(p, 0, MAX_PARTS * 8)
        self.words = <uint64_t *>p
        self.words_mr = mem.dev.reg_mr(mem.pd, p, MAX_PARTS * 8, IBV_ACCESS_LOCAL_WRITE)
        if self.words_mr == NULL:
            err = errno
            raise mem.dev.mr_failed(err, "a channel's grant words", MAX_PARTS * 8)

    def open_window(self):
        """With windows: the block's window (the transport binds it once its QP can
        send), made after the QP: a process's objects are destroyed newest first when
        it dies, and a window bound to a QP must go before it (soft-RoCE waits)."""
        if self.mem.windows and self.head_mw == NULL:
            self.head_mw = self.mem.dev.alloc_mw(self.mem.pd)
            if self.head_mw == NULL:
                raise OSError(errno, "ibv_alloc_mw for a channel's receive block failed")
            self.head_rkey = ibv_inc_rkey(self.head_mw.rkey)

    def peer(self, uint64_t ring_len, uint64_t stride, uint32_t granted, uint32_t rkey):
        """The peer's ring: ``granted`` slots of ``stride`` bytes usable now (0: all)."""
        self.limit = ring_len
        if stride and granted and ring_len % stride == 0 and granted < ring_len // stride:
            self.peer_stride, self.peer_slots = stride, ring_len // stride
            self.peer_granted = granted
            self.limit = <uint64_t>granted * stride
        self.part_end[0], self.part_rkey[0], self.n_parts = self.limit, rkey, 1

    cdef int offer(self, uint64_t ask) noexcept nogil:
        """Register the next part of my ring (what the peer's flag ``ask`` asks for,
        else twice what is granted: next_grant), unless one is waiting to be sent; -1
        if there is nothing to send or another thread is at it, else the index k of
        the grant word to post (words[k]), with the lock held until done()."""
        cdef uint32_t have = self.granted, new, k
        cdef uint64_t ln
        cdef ibv_mr *mr = NULL
        cdef ibv_mw *mw = NULL
        if not self.on or self.stopped or not rm_spin_trylock(&self.lock):
            return -1
        if self.pending == 0:
            if have >= self.slots:
                rm_spin_unlock(&self.lock)
                return -1
            new = next_grant(have, self.slots, ask)
            ln = <uint64_t>(new - have) * self.stride
            if self.n_mrs < MAX_PARTS and pin_charge(ln) == 0:
                mr = self.mem.dev.reg_mr(self.mem.pd,
                                         self.base + self.off + <uint64_t>have * self.stride,
                                         ln, self.mem.remote_flags(IBV_ACCESS_REMOTE_WRITE))
                if mr != NULL and self.mem.windows:
                    mw = self.mem.dev.alloc_mw(self.mem.pd)
                    if mw == NULL:
                        self.mem.dev.dereg_mr(mr)
                        mr = NULL
                if mr == NULL:
                    pin_refund(ln)
                else:
                    self.charged += ln
            if mr == NULL:              # past the budget: the ring stays as it is
                self.stopped = True
                rm_spin_unlock(&self.lock)
                return -1
            k = self.n_mrs
            self.mrs[k], self.mws[k] = mr, mw
            self.n_mrs = k + 1
            # the key of the window (bound with the grant word's WRITE), else the MR's
            self.words[k] = (<uint64_t>new << 32) | (
                ibv_inc_rkey(mw.rkey) if mw != NULL else mr.rkey)
            self.pending = new
        return self.n_mrs - 1

    cdef void done(self, bint posted) noexcept nogil:
        """After offer(): the word was posted (the peer may use the part) or not yet."""
        if posted:
            self.granted, self.pending = self.pending, 0
            self.given += 1
        rm_spin_unlock(&self.lock)

    cdef bint take(self, const char *ctrl) noexcept nogil:
        """Take the peer's new grant words from my control page ``ctrl`` (each read
        once, then checked: more slots than granted, no more than its ring). A bad
        one ends the taking: the peer only keeps itself short."""
        cdef uint64_t word
        cdef uint32_t slots
        cdef bint got = False
        if self.peer_granted == 0 or self.peer_bad:
            return False
        while self.n_parts < MAX_PARTS:
            word = rm_load_acquire64(<uint64_t *>(ctrl + GRANT_OFF) + (self.n_parts - 1))
            if word == 0:
                break
            slots = <uint32_t>(word >> 32)
            if slots <= self.peer_granted or slots > self.peer_slots:
                self.peer_bad = True
                break
            self.limit = <uint64_t>slots * self.peer_stride
            self.part_end[self.n_parts], self.part_rkey[self.n_parts] = self.limit, <uint32_t>word
            self.n_parts += 1
            self.taken += 1
            got = True
            if slots == self.peer_slots:
                self.peer_granted = 0       # all of it
                break
            self.peer_granted = slots
        return got

    def usage(self):
        """(MRs, bytes) registered here: the block's parts, the grant words."""
        cdef uint32_t i
        cdef size_t n = 0, nbytes = 0
        for i in range(self.n_mrs):
            n, nbytes = n + 1, nbytes + self.mrs[i].length
        for mr in (<size_t>self.head_mr, <size_t>self.words_mr):
            if mr:
                n, nbytes = n + 1, nbytes + (<ibv_mr *>mr).length
        return n, nbytes

    cdef void drop_windows(self) noexcept:
        """Free the windows: before the QP they are bound to is destroyed."""
        cdef uint32_t i
        if self.mem is None or self.mem.dev.inherited():
            return
        for i in range(self.n_mrs):
            if self.mws[i] != NULL:
                self.mem.dev.dealloc_mw(self.mws[i])
                self.mws[i] = NULL
        if self.head_mw != NULL:
            self.mem.dev.dealloc_mw(self.head_mw)
            self.head_mw = NULL

    cdef void release(self) noexcept:
        """Give the pins back and deregister (nothing in a fork child: the parent's)."""
        cdef uint32_t i
        pin_refund(self.charged)
        self.charged = 0
        if self.mem is None or self.mem.dev.inherited():
            self.n_mrs = 0
            self.words_mr = self.head_mr = NULL
            self.head_mw = NULL
            return
        self.drop_windows()             # first: an MR under a window stays
        for i in range(self.n_mrs):
            self.mem.dev.dereg_mr(self.mrs[i])
        self.n_mrs = 0
        if self.words_mr != NULL:
            self.mem.dev.dereg_mr(self.words_mr)
            self.words_mr = NULL
        if self.head_mr != NULL:
            self.mem.dev.dereg_mr(self.head_mr)
            self.head_mr = NULL

    def __dealloc__(self):
        self.release()
        free(self.words)
        if self.base != NULL:       # after the transport: Messages may point into it
            munmap(self.base, self.length)



def grant_after(uint32_t have, uint32_t slots, uint64_t ask):
    """The slots of a ring of ``slots`` granted after one grant from ``have``, for a
    credit flag of ``ask`` (next_grant, as offer() registers it)."""
    return next_grant(have, slots, ask)
