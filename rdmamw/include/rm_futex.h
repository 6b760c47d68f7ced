/* The two futex operations the engine's call locks sleep and wake with (Linux):
 * a sleep returns when woken, when *addr no longer holds val (at once) or after ns. */
#ifndef RM_FUTEX_H
#define RM_FUTEX_H
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline void rm_futex_wait(int *addr, int val, int64_t ns) {
    struct timespec ts;
    if (ns <= 0) return;
    ts.tv_sec = (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, val, &ts, NULL, 0);
}
static inline void rm_futex_wake_one(int *addr) {
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
#endif
