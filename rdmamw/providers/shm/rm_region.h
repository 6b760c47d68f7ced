/* Remote memory regions on shm (docs/remote-memory.md): one 64-byte record in each
 * block, after the assist record, in the page the exposure table already rounds up to
 * (so the block keeps its size and an older peer its layout).
 *
 * `id`: the endpoint's random identity, written once by the block's owner at set-up; a
 *   reader compares a region reference's channel identity with the peer's `id`.
 * `busy`: written only by the block's owner, as the *initiator* of region accesses:
 *   (seq << 1) | 1 while any chain of region READs/WRITEs into the peer runs (threads'
 *   chains may overlap: it turns even when the last ends), seq << 1 after. The exposing side's revoke withdraws the entry from its mirror, fences, and
 *   waits while the peer's `busy` is odd and unchanged: the access in progress ends
 *   (and one that begins later finds the entry gone: both sides store, fence, then
 *   load, so at least one sees the other).
 *
 * A region exposure's entry carries the region's tag (its generation, never 0) in the
 * bits of `access` above RM_XTAG_SHIFT; rendezvous entries have none, so a region
 * request never matches a rendezvous exposure nor the reverse. */
#ifndef RM_REGION_H
#define RM_REGION_H
#include <stdint.h>
#include "rm_expose.h"

enum { RM_XTAG_SHIFT = 8 };
enum { RM_RWHY_OK = 0, RM_RWHY_GONE = 1, RM_RWHY_RANGE = 2, RM_RWHY_ACCESS = 3 };

typedef struct {
    uint64_t id;
    uint64_t busy;
    uint64_t pad[6];
} rm_region_rec;        /* 64 bytes */

/* Why a region request {key, tag, [addr, addr+len), access} fails against the table `t`
 * (the peer's mirror): RM_RWHY_*, read once like rm_xtab_find. */
static inline int rm_region_why(const rm_xtab *t, uint32_t key, uint32_t tag, uint64_t addr,
                                uint64_t len, uint32_t access) {
    rm_xent e;
    uint32_t i = key & 0xFF;
    if (key == 0 || (key >> 16) || i >= RM_XTAB_N || tag == 0) return RM_RWHY_GONE;
    if (__atomic_load_n(&t->e[i].key, __ATOMIC_ACQUIRE) != key) return RM_RWHY_GONE;
    e.addr = __atomic_load_n(&t->e[i].addr, __ATOMIC_RELAXED);
    e.len = __atomic_load_n(&t->e[i].len, __ATOMIC_RELAXED);
    e.access = __atomic_load_n(&t->e[i].access, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&t->e[i].key, __ATOMIC_RELAXED) != key) return RM_RWHY_GONE;
    if ((e.access >> RM_XTAG_SHIFT) != tag) return RM_RWHY_GONE;
    if (addr < e.addr || len > e.len || addr - e.addr > e.len - len) return RM_RWHY_RANGE;
    if ((e.access & access) != access) return RM_RWHY_ACCESS;
    return RM_RWHY_OK;
}
#endif
