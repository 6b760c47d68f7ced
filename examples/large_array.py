"""Send a 256 MiB numpy array by rendezvous, straight into the receiver's own array.

    python examples/large_array.py                    # 256 MiB, strategy from the tuning
    python examples/large_array.py --mib 64 --rendezvous write

Above the eager limit (the peer's slot size, 64 KiB by default) a message is not
copied through the ring: the slot carries a descriptor, and the receiver's
``recv_into`` pulls the bytes into the destination it gives (on ``shm`` one
``process_vm_readv`` copy; a RDMA READ on verbs). With ``rendezvous="write"`` the
receiver posts its array first (``post_recv``) and the sender writes into it. The
sender's ``SendHandle`` says when its array may be modified again.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import numpy as np

import rdmamw


def sender(address: str, mib: int, rendezvous: str) -> None:
    ch = rdmamw.Channel.open(address, timeout=30, rendezvous=rendezvous)
    x = np.arange(mib << 18, dtype=np.float32)           # mib MiB of float32
    ch.send_batch([b"ready"]).wait()                      # (so the receiver's clock
    handle = ch.send_batch([x])                           #  leaves out our start-up)
    handle.wait()                                         # x may be reused from here on
    ch.recv(timeout=60)                                   # the receiver's "checked"
    print(f"sender: {x.nbytes >> 20} MiB sent; counters "
          + ", ".join(f"{k} {v}" for k, v in ch.stats().items() if k.startswith("rndv")))
    ch.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="array size in MiB (default 256)")
    ap.add_argument("--rendezvous", default="auto", choices=("auto", "read", "write"))
    a = ap.parse_args()
    address = f"shm://large-array-{os.getpid()}"
    with rdmamw.listen(address, rendezvous=a.rendezvous) as lst:
        p = mp.get_context("spawn").Process(target=sender, args=(address, a.mib, a.rendezvous))
        p.start()
        ch = lst.accept(timeout=30)
        dst = np.zeros(a.mib << 18, dtype=np.float32)    # preallocated destination
        dst.fill(1)                                       # touched, as a reused buffer is
        if a.rendezvous == "write":
            ch.post_recv(dst)                             # the sender writes into dst
        ch.recv(timeout=60)                               # "ready"
        t0 = time.perf_counter()
        if a.rendezvous == "write":
            m = ch.recv(timeout=60)
            n = len(m)
            del m                                         # dst is ours again
        else:
            n = ch.recv_into(dst, timeout=60)             # lands in dst, no extra copy
        dt = time.perf_counter() - t0
        ok = n == dst.nbytes and np.array_equal(dst, np.arange(dst.size, dtype=np.float32))
        ch.send_batch([b"checked"]).wait()
        print(f"receiver: {n >> 20} MiB in {dt * 1e3:.1f} ms ({n / dt / 1e9:.2f} GB/s), "
              f"content {'correct' if ok else 'WRONG'}")
        p.join(60)
        ch.close()
    return 0 if ok and p.exitcode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
