# cython: freethreading_compatible = False
"""Leases of the channel's registration caches (rdmamw.memory.regcache), as the
rendezvous units take and end them: a cache is passed in at set-up, never imported."""

from cpython.ref cimport Py_XDECREF

from rdmamw.errors import ChannelClosed, MessageTooLarge, RegistrationError


cdef object take_lease(object cache, object buf, bint closed):
    """A Lease of ``cache`` on ``buf``: its owner is registered once, then reused;
    ``lease.handle`` is the transport's (mr, lkey, rkey). A refused registration first
    lets the idle cached ones go (they may be what exhausts the pinning limit)."""
    try:
        try:
            lease = cache.acquire(buf)
        except OSError:
            cache.clear()
            lease = cache.acquire(buf)
    except OSError as e:
        raise MessageTooLarge(f"the transport could not register a rendezvous buffer "
                              f"({e}); nothing was sent") from e
    except RegistrationError as e:
        if closed:
            raise ChannelClosed("this side closed the channel") from e
        raise
    return lease


cdef int end_lease(object lease) except -1:
    """End a Lease; one released already (the cache was closed under it) is fine."""
    try:
        lease.release()
    except RegistrationError:
        pass
    return 0


cdef void end_owned(PyObject *lease) noexcept:
    """End a Lease we hold a reference to (taken with Py_XINCREF) and drop that
    reference (GIL held)."""
    cdef object obj = <object>lease
    Py_XDECREF(lease)
    end_lease(obj)
