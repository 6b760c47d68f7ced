# cython: freethreading_compatible = False
"""The servers' SGD step fused into one loop over the arrays, GIL released: one pass
over g, v and w (and the pulled copy for delay compensation) instead of five numpy
passes. rdmamw/ps/optim.py calls it for float32 / float64 and says the maths."""

cimport cython

ctypedef fused real:
    float
    double


cdef inline void _same(Py_ssize_t a, Py_ssize_t b, str what) except *:
    if a != b:
        raise ValueError(f"{what}: {a} elements, expected {b}")


@cython.boundscheck(False)
@cython.wraparound(False)
def step(real[::1] w, real[::1] v, const real[::1] g, double scale, double lr,
         double momentum, double dc, const real[::1] bak=None):
    """v = momentum v + scale (g + dc g g (w - bak)); w -= lr v (dc term only with bak)."""
    cdef Py_ssize_t i, n = g.shape[0]
    _same(w.shape[0], n, "model")
    _same(v.shape[0], n, "velocity")
    cdef real s = <real>scale, r = <real>lr, m = <real>momentum, d = <real>dc, gi
    cdef bint comp = dc > 0 and bak is not None
    if comp:
        _same(bak.shape[0], n, "pulled copy")
    with nogil:
        if comp:
            for i in range(n):
                gi = g[i]
                gi = gi + d * gi * gi * (w[i] - bak[i])
                v[i] = m * v[i] + s * gi
                w[i] -= r * v[i]
        else:
            for i in range(n):
                v[i] = m * v[i] + s * g[i]
                w[i] -= r * v[i]


@cython.boundscheck(False)
@cython.wraparound(False)
def accumulate(real[::1] acc, const real[::1] g, const real[::1] w, double dc,
               const real[::1] bak=None):
    """acc += g + dc g g (w - bak) (the dc term only with bak)."""
    cdef Py_ssize_t i, n = g.shape[0]
    _same(acc.shape[0], n, "accumulator")
    cdef real d = <real>dc, gi
    cdef bint comp = dc > 0 and bak is not None
    if comp:
        _same(w.shape[0], n, "model")
        _same(bak.shape[0], n, "pulled copy")
    with nogil:
        if comp:
            for i in range(n):
                gi = g[i]
                acc[i] += gi + d * gi * gi * (w[i] - bak[i])
        else:
            for i in range(n):
                acc[i] += g[i]
