# cython: freethreading_compatible = False
"""The ``verbs`` provider's library: libibverbs dlopen()ed on first use (the extensions
never link it, so one build runs with and without rdma-core), rdma-core's fork rule,
and a probe of the devices that needs no pyverbs."""

import logging
import os

from rdmamw import config

from libc.errno cimport errno
from libc.string cimport strerror

from rdmamw.providers.verbs._ibverbs cimport *

cdef enum:
    MAX_TABLES = 16     # the provider's extensions (and the test hooks') with a table

cdef table_filler _fillers[MAX_TABLES]
cdef int _n_fillers = 0


cdef int also_load(table_filler fill) except -1:
    """Fill ``fill``'s table whenever load() runs (at once if it ran already)."""
    global _n_fillers
    cdef char err[1024]
    if _n_fillers == MAX_TABLES:
        raise RuntimeError("too many libibverbs tables")
    _fillers[_n_fillers] = fill
    _n_fillers += 1
    if rm_ibv_loaded() and fill(rm_ibv_path, err, sizeof(err)) != 0:
        raise OSError(2, f"{rm_ibv_path.decode(errors='replace')} lacks "
                         f"{err.decode(errors='replace')}")
    return 0


def load() -> str:
    """dlopen libibverbs (RDMAMW_VERBS_LIBRARY, default libibverbs.so.1, read on the
    first call) and resolve every function the extensions of the provider call, once;
    return the path of the library loaded. OSError naming the library or the missing
    symbols."""
    cdef char err[1024]
    cdef int rc = 0, i
    lib = config.get("RDMAMW_VERBS_LIBRARY")
    if not rm_ibv_loaded():
        rc = rm_ibv_load(lib.encode(), err, sizeof(err))
    for i in range(_n_fillers):     # every extension's table: the same library
        if rc == 0:
            rc = _fillers[i](rm_ibv_path, err, sizeof(err))
    if rc == -1:
        raise OSError(2, f"cannot load {lib} ({err.decode(errors='replace')}); install "
                         f"rdma-core (libibverbs1) or point RDMAMW_VERBS_LIBRARY at it")
    if rc != 0:
        raise OSError(2, f"{rm_ibv_path.decode(errors='replace')} lacks "
                         f"{err.decode(errors='replace')} (not libibverbs, or older than "
                         f"rdma-core's libibverbs 1.1)")
    return rm_ibv_path.decode(errors="replace")


cdef int require() except -1:
    if not rm_ibv_loaded():
        load()
    return 0


cdef int _fork_init_rc = -1


def fork_safety() -> str:
    """rdma-core's fork rule, applied once before the first device is opened:
    "unneeded" when the kernel copies DMA-pinned pages at fork (5.13+; rdma-core asks it
    over netlink): then ``ibv_fork_init()`` is *not* called, because rdma-core 44
    (Debian 12) still marks every registered range MADV_DONTFORK when it is, and a
    registration of heap memory takes whole pages of the Python heap out of every
    child (children crash at once; test_fork.py in the VM). On older kernels it is
    called: "enabled" (registered pages are not mapped in a child), or "disabled" if
    memory was registered before (EINVAL). RDMAV_FORK_SAFE / IBV_FORK_SAFE make
    libibverbs call it anyway: a warning says so."""
    global _fork_init_rc
    require()
    cdef int status = <int>ibv_is_fork_initialized()
    if _fork_init_rc < 0:
        _fork_init_rc = 0
        if status != IBV_FORK_UNNEEDED:
            _fork_init_rc = ibv_fork_init()
            status = <int>ibv_is_fork_initialized()
        elif os.environ.get("RDMAV_FORK_SAFE") or os.environ.get("IBV_FORK_SAFE"):
            logging.getLogger("rdmamw.verbs").warning(
                "RDMAV_FORK_SAFE/IBV_FORK_SAFE is set although this kernel copies "
                "pinned pages at fork: registered pages of the Python heap will be "
                "missing in fork children (unset it)")
    return ("disabled", "enabled", "unneeded")[min(max(status, 0), 2)]


def probe(int max_gids=32):
    """Devices, ports and non-zero GIDs as libibverbs reports them (no pyverbs)."""
    cdef int num = 0, i, p, g
    cdef ibv_device **lst
    require()
    lst = ibv_get_device_list(&num)
    cdef ibv_context *ctx
    cdef ibv_device_attr dattr
    cdef ibv_port_attr pattr
    cdef ibv_gid gid
    if lst == NULL:
        raise OSError(errno, f"ibv_get_device_list: {strerror(errno).decode()}")
    out = []
    try:
        for i in range(num):
            name = ibv_get_device_name(lst[i]).decode()
            ctx = ibv_open_device(lst[i])
            if ctx == NULL:
                out.append({"name": name, "error": f"cannot open: {strerror(errno).decode()}"})
                continue
            ports = []
            if ibv_query_device(ctx, &dattr) == 0:
                for p in range(1, dattr.phys_port_cnt + 1):
                    if ibv_query_port(ctx, p, &pattr):
                        continue
                    gids = []
                    for g in range(min(pattr.gid_tbl_len, max_gids)):
                        if ibv_query_gid(ctx, p, g, &gid) == 0 and any(gid.raw[:16]):
                            gids.append((g, bytes(gid.raw[:16])))
                    ports.append({"port": p, "active": pattr.state == IBV_PORT_ACTIVE,
                                  "state": pattr.state, "lid": pattr.lid,
                                  "mtu": pattr.active_mtu, "link_layer": pattr.link_layer,
                                  "gids": gids})
            out.append({"name": name, "ports": ports, "max_qp_wr": dattr.max_qp_wr})
            ibv_close_device(ctx)
    finally:
        ibv_free_device_list(lst)
    return out

