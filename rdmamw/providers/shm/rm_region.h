/* Remote memory regions on shm (docs/remote-memory.md): one 64-byte record in each
 * block, after the assist record, in the page the exposure table already rounds up to
 * (so the block keeps its size and an older peer its layout).
 *
 * `id`: the endpoint's random identity, written once by the block's owner at set-up; a
 *   reader compares a region reference's channel identity with the peer's `id`.
 * `busy`: written only by the block's owner, as the *initiator* of region accesses:
 *   (seq << 1) | 1 while any chain of region READs/WRITEs into the peer runs (threads'
 *   chains may overlap: it turns even when the last ends), seq << 1 after. The
 *   exposing side's revoke withdraws the entry from its mirror, fences, and
 *   waits while the peer's `busy` is odd and unchanged: the access in progress ends
 *   (and one that begins later finds the entry gone: both sides store, fence, then
 *   load, so at least one sees the other).
 *
 * A region exposure's entry carries the region's tag (rm_expose.h, rm_region_why). */
#ifndef RM_REGION_H
#define RM_REGION_H
#include <stdint.h>
#include "rm_expose.h"

typedef struct {
    uint64_t id;
    uint64_t busy;
    uint64_t pad[6];
} rm_region_rec;        /* 64 bytes */

#endif
