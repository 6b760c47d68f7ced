from cpython.ref cimport PyObject
from libc.stdint cimport uint8_t, uint32_t, uint64_t

from rdmamw.engine._batch cimport SendBatch
from rdmamw.engine._frames cimport rm_desc
from rdmamw.engine._link cimport Link
from rdmamw.transport._base cimport rm_mem, rm_wr


cdef class RndvSender:
    cdef Link link
    cdef SendBatch batch
    cdef bint write                 # WRITE into advertised destinations when they fit
    cdef readonly uint32_t prep_i   # messages of the batch prepared (exposed) so far
    # entry e = index % RNDV_N keeps the source until its done bit comes back
    cdef uint64_t next              # rendezvous messages prepared (the next index)
    cdef readonly uint64_t upto     # ... of which done (in order)
    cdef uint64_t released          # ... of which source released (GIL)
    cdef uint64_t shadow            # phase word I own; the peer's done word follows it
    cdef Py_buffer buf[64]
    cdef uint8_t held[64]
    cdef rm_mem mem[64]
    cdef rm_desc desc[64]
    cdef uint64_t waddr[64]         # DESC_WRITTEN: the advertised destination
    cdef uint32_t wkey[64]
    cdef PyObject *lease[64]        # the Lease of the entry's source (owned)

    cdef void give_back(self) noexcept
    cdef uint32_t prepare_rndv(self, uint32_t k, uint32_t want, int *rc) noexcept nogil
    cdef int prepare_one(self, uint32_t i) noexcept nogil
    cdef void unprepare(self, uint32_t first) noexcept
    cdef uint32_t desc_record(self, uint32_t i, char *p, rm_wr *wrs, uint32_t nw) noexcept nogil
    cdef void reap(self) noexcept nogil
    cdef void release(self) noexcept
    cdef bint poll(self, uint64_t target) noexcept
    cdef bint ready(self, int what, uint64_t target) noexcept nogil

    # once per send call (inline: no call on the common path)
    cdef inline void begin(self) noexcept:
        """A send call starts: nothing of its batch prepared yet; sources already
        done go back first (they may free entries)."""
        self.prep_i = 0
        if self.released < self.next:
            self.poll(self.next)

    cdef inline void end(self, uint32_t posted) noexcept:
        """The send call ends with its messages before ``posted`` posted: the ones
        prepared past it were not sent (timeout, error) and are undone."""
        if self.prep_i > posted:
            self.unprepare(posted)

    cdef inline uint32_t prepare(self, uint32_t k, uint32_t want, int *rc) noexcept nogil:
        """Expose the rendezvous messages of planned slots k..k+want in order while
        entries (and the provider) allow; return how many of those slots are ready.
        An all-eager batch (most) has nothing to expose: no call."""
        if self.batch.nrndv == 0:
            self.prep_i = self.batch.plan_start[k + want]
            return want
        return self.prepare_rndv(k, want, rc)
