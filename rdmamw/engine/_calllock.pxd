# The locks that let one send and one receive call at a time into an endpoint.
#
# A call takes its lock with the GIL held and gives it back with the GIL held; the GIL
# orders those state changes, so the uncontended path is a load and a store (no atomic
# read-modify-write, no libc call: a PyThread lock cost ~130 instructions per call and
# twice an atomic). Only a thread that finds the lock taken sleeps, on a futex, with
# the GIL released: it marks the word WAITED first (with the GIL), and the call that
# gives the lock back wakes one sleeper when it finds that mark. A sleeper that takes
# the lock keeps the mark (others may still sleep: Drepper's "Futexes are tricky",
# mutex 2). The modules are not free-threading compatible, which this relies on.
from libc.stdint cimport int64_t

from rdmamw.transport._base cimport now_ns

cdef extern from "rm_futex.h" nogil:
    void rm_futex_wait(int *addr, int val, int64_t ns)
    void rm_futex_wake_one(int *addr)

cdef enum:
    FREE = 0
    TAKEN = 1
    WAITED = 2      # taken, and a thread may sleep on it


cdef inline bint try_take(int *lock) noexcept:
    """Take the lock if it is free (GIL held)."""
    if lock[0] == FREE:
        lock[0] = TAKEN
        return True
    return False


cdef inline bint take_until(int *lock, int64_t until) noexcept:
    """Take the lock, sleeping with the GIL released until ``until`` (now_ns) at most:
    False when it stayed taken that long (GIL held on entry and return)."""
    cdef int64_t left
    if try_take(lock):
        return True
    while True:
        lock[0] = WAITED
        left = until - now_ns()
        if left <= 0:
            return False
        with nogil:
            rm_futex_wait(lock, WAITED, left)
        if lock[0] == FREE:
            lock[0] = WAITED
            return True


cdef inline void give(int *lock) noexcept:
    """Give the lock back (GIL held); wake a sleeper if one may wait."""
    cdef bint waited = lock[0] == WAITED
    lock[0] = FREE
    if waited:
        rm_futex_wake_one(lock)
