"""The one narrow interface between the batch engine (above) and the providers (below).

``_base.pxd`` declares the mini-verbs: work requests and completions, return codes,
the clock and the :class:`Transport` every provider subclasses; ``atomics.pxd`` the
shared primitives; :mod:`~rdmamw.transport.layout` where each region of an endpoint's
block lives; :mod:`~rdmamw.transport.wire` the set-up frames, the protocol version and
the mode names. Providers and the engine depend on this package; it depends on
neither."""
