from libc.stdint cimport int64_t, uint32_t, uint64_t

from rdmamw.engine._eager_recv cimport EagerReceiver
from rdmamw.engine._frames cimport rm_desc
from rdmamw.engine._link cimport Link
from rdmamw.engine._messages cimport Dest, Endpoint, Message
from rdmamw.engine._waits cimport Waiter
from rdmamw.transport._base cimport rm_mem


cdef class Posted:
    cdef Dest dest
    cdef uint64_t index             # the rendezvous index it is for
    cdef bint advertised            # with "write": exposed and announced to the sender
    cdef rm_mem adv


cdef class RndvReceiver:
    cdef Link link
    cdef EagerReceiver rx
    cdef Waiter w                   # the endpoint's one wait loop (a READ's wait too)
    cdef bint write                 # advertise posted destinations (sender WRITEs)
    cdef readonly uint64_t next     # the next rendezvous index expected
    cdef object posted              # deque of Posted (post_recv's Dests), in index order
    cdef uint64_t *advsrc           # sources of advert writes (registered)
    cdef uint32_t lkey_adv
    cdef readonly uint64_t max_msg  # the largest message this side takes
    cdef int64_t rx_until           # the running receive call's deadline (0: none)
    cdef uint64_t last_len          # length of the message receive() brought in
    # a READ still in flight when a receive timed out: its destination, the
    # destination's lease or exposure, its descriptor, index + 1 (0: none), and
    # whether rd_dst is a recv_into buffer
    cdef Dest rd_dst
    cdef object rd_lease
    cdef rm_mem rd_mem
    cdef rm_desc rd_desc
    cdef uint64_t rd_want
    cdef bint rd_user
    cdef readonly object regcache_dst   # destinations we READ into (verbs; local access)
    # a writable buffer of n bytes for a message without a posted or given destination:
    # the channel's pool (rdmamw.channel.rendezvous.allocate), passed in at set-up
    cdef readonly object allocate

    cdef inline void set_deadline(self, int64_t deadline) noexcept:
        """The running receive call's deadline (0: none): a READ outliving it stays in
        flight for the next call (inline: once per receive call)."""
        self.rx_until = deadline

    cdef int use(self, object regcache_dst, object allocate) except -1
    cdef Dest receive(self, char *base, Dest into)
    cdef Py_ssize_t deliver_into(self, Dest into) except -2
    cdef Message take(self, Endpoint eng, char *base)
    cdef int post(self, Dest d) except -1
    cdef void drop_posted(self) noexcept
    cdef int drop_all(self) except -1
    cdef int end_read(self) except -1
    cdef int _check_room(self, Dest dst, Dest posted, rm_desc *d) except -1
    cdef void _consumed(self, rm_desc *d) noexcept
    cdef int _refuse(self, rm_desc *d, Dest posted) except -1
    cdef int _skip(self, rm_desc *d, Dest posted) except -1
    cdef int _cut(self, int64_t deadline) except -1
    cdef int _check_desc(self, rm_desc *d) except -1
    cdef int _read_into(self, Dest dst, rm_desc *d, bint user) except -1
    cdef Dest _resume_read(self, rm_desc *d, Dest into, Dest posted)
    cdef int _wait_read(self) except -1
    cdef int _raise_read(self, int rc, rm_desc *d) except -1
