/* Atomics on a tcp region, the owner's side (docs/remote-memory.md, "tcp atomics";
 * docs/protocol.md, "Atomics in a chain"): the op codes an RCHAIN descriptor names them
 * by, and the one place the owner's word changes, with the CPU's atomic instruction,
 * under the lock a revoke takes. rm_tcp_region.h receives and answers them. */
#ifndef RM_TCP_ATOMIC_H
#define RM_TCP_ATOMIC_H
#include <pthread.h>
#include <stdint.h>
#include "rm_tcp_conn.h"

enum { RT_OP_READ = 1, RT_OP_WRITE = 2, RT_OP_FADD = 3, RT_OP_CSWAP = 4 };
#define RT_ATOMIC_OPERANDS 16           /* an atomic's payload: two 64-bit words */

/* Run the atomic `op` (RT_OP_FADD / RT_OP_CSWAP) on the aligned word at addr of the
 * region key/tag with the operands a, b, holding xw_mu (a revoke waits for it, so the
 * word is exposed while it changes): RM_RWHY_* (unaligned: RM_RWHY_ACCESS), and the
 * word's old value in *old when it is 0. Atomic with respect to every other atomic
 * instruction on the word (another peer's, served by its own connection's thread, or
 * the owner's own). */
static int rt_xatomic(rt_conn *c, uint16_t op, uint32_t key, uint32_t tag, uint64_t addr,
                      uint64_t a, uint64_t b, uint64_t *old) {
    uint64_t *word = (uint64_t *)(uintptr_t)addr;
    int why;
    pthread_mutex_lock(&c->xw_mu);
    why = rm_region_why(c->xtab, key, tag, addr, 8, RM_XACC_ATOMIC);
    if (!why && (addr & 7)) why = RM_RWHY_ACCESS;
    if (!why) {
        if (op == RT_OP_FADD) {
            *old = __atomic_fetch_add(word, a, __ATOMIC_SEQ_CST);
        } else {
            *old = a;
            __atomic_compare_exchange_n(word, old, b, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
        }
    }
    pthread_mutex_unlock(&c->xw_mu);
    return why;
}
#endif
