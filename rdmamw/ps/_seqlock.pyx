# cython: freethreading_compatible = False
"""The writer's half of a seqlock over a shard a peer reads one-sided (docs/ps.md,
"One-sided pull"): word 0 of the shard's header turns odd before the shard changes
and even after, with the fences a reader in another process needs (the odd word
visible before any changed byte, every changed byte before the even word). Plain
numpy stores give no such order on a weakly-ordered CPU; on x86-64 the fences cost
nothing but keep the compiler from moving the stores."""

from libc.stdint cimport uint64_t

cdef extern from *:
    """
    static inline void ps_seq_begin(uint64_t *p) {
        uint64_t s = __atomic_load_n(p, __ATOMIC_RELAXED);
        __atomic_store_n(p, s + 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);   /* odd word before the data */
    }
    static inline void ps_seq_end(uint64_t *p, uint64_t version, uint64_t merged) {
        uint64_t s = __atomic_load_n(p, __ATOMIC_RELAXED);
        __atomic_store_n(p + 1, version, __ATOMIC_RELAXED);
        __atomic_store_n(p + 2, merged, __ATOMIC_RELAXED);
        __atomic_store_n(p, s + 1, __ATOMIC_RELEASE);   /* the data before the even word */
    }
    """
    void ps_seq_begin(uint64_t *p) nogil
    void ps_seq_end(uint64_t *p, uint64_t version, uint64_t merged) nogil


def begin(uint64_t[::1] header) -> None:
    """The shard is about to change: word 0 turns odd (ValueError if it is already)."""
    if header.shape[0] < 3:
        raise ValueError(f"a shard header has 3 words, not {header.shape[0]}")
    if header[0] & 1:
        raise ValueError("the shard is already being changed (word 0 is odd)")
    ps_seq_begin(&header[0])


def end(uint64_t[::1] header, uint64_t version, uint64_t merged) -> None:
    """The shard has changed: the model ``version`` and ``merged`` count in words 1
    and 2, then word 0 turns even (ValueError if :func:`begin` did not come first)."""
    if header.shape[0] < 3:
        raise ValueError(f"a shard header has 3 words, not {header.shape[0]}")
    if not header[0] & 1:
        raise ValueError("end() without begin() (word 0 is even)")
    ps_seq_end(&header[0], version, merged)
