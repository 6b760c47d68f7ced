/* Atomics on shm regions (docs/remote-memory.md, "shm atomics"): an "atomic" region
 * lies in memory rdmamw allocated as a shared mapping (rdmamw.memory.shared(): a
 * sealed memfd). The owner names, in its block, the file and the offset of each
 * exposure in such memory, whatever its access (`rm_xfile`, after the region record:
 * one word per exposure-table slot, written before the slot's key is mirrored; reads
 * and writes of it are copies through the peer's mapping: _mapped.pxd); the peer
 * takes the descriptor once with
 * pidfd_getfd() (the same ptrace permission as cross-memory attach), maps the
 * exposure's pages, and runs the CPU's atomic instruction on its own mapping of the
 * owner's word. Every field of the owner's block is read once into a local and checked
 * there; the mapping is bounded by the exposure (and the file's size, sealed). */
#ifndef RM_SHARED_H
#define RM_SHARED_H
#include <fcntl.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include "rm_expose.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef F_SEAL_SHRINK
#define F_SEAL_SHRINK 0x0002
#endif

#define RM_XFILE_OFF_BITS 44     /* a file word: (fd + 1) << 44 | offset; 0: no file */
#define RM_XFILE_OFF_MASK ((UINT64_C(1) << RM_XFILE_OFF_BITS) - 1)

typedef struct {
    uint64_t file[RM_XTAB_N];   /* per slot of the mirror: the exposure's file word */
} rm_xfile;                     /* 2040 bytes, in the page the table rounds up to */

/* The peer's mapping of one exposure's pages (the initiator's cache, per slot). */
typedef struct {
    uint32_t key, tag;
    uint64_t file;      /* the file word it was made for */
    uint64_t addr;      /* the owner's address of the exposure's first byte */
    uint64_t len;
    char *map;          /* my mapping of the pages under [addr, addr + len) */
    uint64_t maplen;
    uint64_t delta;     /* the exposure's first byte in my mapping */
    uint32_t users;     /* copies through it now (_mapped.pxd): not remade meanwhile */
} rm_smap;

static inline uint64_t rm_xfile_word(int fd, uint64_t off) {
    if (fd < 0 || off > RM_XFILE_OFF_MASK || (uint64_t)fd >= (UINT64_C(1) << 19)) return 0;
    return ((uint64_t)(fd + 1) << RM_XFILE_OFF_BITS) | off;
}

static inline void rm_smap_drop(rm_smap *m) {
    if (m->map) munmap(m->map, m->maplen);
    m->map = 0;
    m->key = 0;
}

/* Map the exposure {key, tag, addr, len} named by the file word `file` of the process
 * behind `pidfd` into `m`: 0, or -1 (no such descriptor, not a memfd sealed against
 * shrinking, the range past the file's end, no mapping). */
static inline int rm_smap_make(rm_smap *m, int pidfd, uint32_t key, uint32_t tag,
                               uint64_t file, uint64_t addr, uint64_t len) {
    uint64_t off = file & RM_XFILE_OFF_MASK, start, maplen;
    long page = sysconf(_SC_PAGESIZE);
    int fd, seals;
    struct stat st;
    void *p;
    rm_smap_drop(m);
    if (file == 0 || pidfd < 0 || len == 0 || off + len < off) return -1;
    fd = (int)syscall(SYS_pidfd_getfd, pidfd, (int)((file >> RM_XFILE_OFF_BITS) - 1), 0);
    if (fd < 0) return -1;
    seals = fcntl(fd, F_GET_SEALS);
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || seals < 0 || !(seals & F_SEAL_SHRINK)
        || (uint64_t)st.st_size < off + len) {
        close(fd);
        return -1;
    }
    start = off & ~(uint64_t)(page - 1);
    maplen = (off + len - start + (uint64_t)page - 1) & ~(uint64_t)(page - 1);
    p = mmap(0, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)start);
    close(fd);
    if (p == MAP_FAILED) return -1;
    m->key = key;
    m->tag = tag;
    m->file = file;
    m->addr = addr;
    m->len = len;
    m->map = (char *)p;
    m->maplen = maplen;
    m->delta = off - start;
    return 0;
}

/* fetch_add (cas 0) or compare_swap on the word at the owner's address `at`, which the
 * caller checked lies 8-aligned inside m's exposure: ops[0] the value to add or the
 * expected one, ops[1] the new one; ops[0] becomes the word's old value. */
static inline void rm_smap_atomic(const rm_smap *m, uint64_t at, int cas, uint64_t *ops) {
    uint64_t *word = (uint64_t *)(m->map + m->delta + (at - m->addr));
    uint64_t old;
    if (!cas) {
        ops[0] = __atomic_fetch_add(word, ops[0], __ATOMIC_SEQ_CST);
    } else {
        old = ops[0];
        __atomic_compare_exchange_n(word, &old, ops[1], 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        ops[0] = old;
    }
}
#endif
