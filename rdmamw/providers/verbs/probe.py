"""Is the verbs provider usable here, and on which device, port and GID?

No RDMA is an ordinary case: every answer is a reason string, never an ImportError
of the library. The data-path extension is always built and imported lazily; it
dlopen()s libibverbs.so.1 here, on first use (``library()`` says which file)."""

from __future__ import annotations

import errno
import functools
import importlib

from rdmamw import config
from rdmamw.errors import ProviderUnavailable

SYSFS = "/sys/class/infiniband"


@functools.lru_cache(maxsize=1)
def _module():
    """The verbs extensions' library module (_lib) with libibverbs loaded, or the
    reason it cannot be. The transport's extension is imported first: it and those
    below it hand their tables of calls to _lib.load()."""
    name = "rdmamw.providers.verbs._transport"
    try:
        importlib.import_module(name)
        mod = importlib.import_module("rdmamw.providers.verbs._lib")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("rdmamw.providers.verbs._"):
            raise
        return f"rdmamw was built without the verbs extension ({e.name})"
    try:
        mod.load()
    except OSError as e:
        return e.strerror
    return mod


def library() -> tuple[bool, str]:
    """(loaded, the path of the libibverbs loaded, or why none is)."""
    mod = _module()
    return (False, mod) if isinstance(mod, str) else (True, mod.load())


def transport_class():
    mod = _module()
    if isinstance(mod, str):
        raise ProviderUnavailable(mod)
    from rdmamw.providers.verbs._regions import VerbsRegions
    return VerbsRegions     # a VerbsTransport with user regions (remote memory)


def pinned_budget() -> int:
    """The process's budget of registered (pinned) bytes: RDMAMW_VERBS_PINNED_BYTES, or
    by default half the memory, and no more than ``ulimit -l`` where the kernel holds
    the process to it (without CAP_IPC_LOCK: taken as not root)."""
    import os
    import resource

    set_to = config.get("RDMAMW_VERBS_PINNED_BYTES")
    if set_to:
        return set_to
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY and os.geteuid() != 0:
        budget = min(budget, soft)
    return budget


def check_budget(need: int, what: str) -> None:
    """Apply the budget now (the setting may have changed) and refuse ``need`` more
    bytes for ``what`` if it has no room: RegistrationError naming the budget, before
    anything is registered."""
    mod = _module()
    if isinstance(mod, str):
        raise ProviderUnavailable(mod)
    from rdmamw.providers.verbs import _memory
    _memory.set_pinned_budget(pinned_budget())
    used, budget = _memory.pinned()
    if need > budget or used > budget - need:
        raise _memory.budget_error(need, what)


def gid_type(dev: str, port: int, index: int) -> str:
    """"RoCE v2", "IB/RoCE v1", or "" when sysfs does not say."""
    try:
        with open(f"{SYSFS}/{dev}/ports/{port}/gid_attrs/types/{index}") as f:
            return f.read().strip()
    except OSError:
        return ""


def devices() -> list[dict]:
    """Devices with ports and GIDs (each GID with its sysfs type); raises
    ProviderUnavailable with the reason when libibverbs cannot be asked."""
    mod = _module()
    if isinstance(mod, str):
        raise ProviderUnavailable(mod)
    try:
        found = mod.probe()
    except OSError as e:
        if e.errno == errno.ENOSYS:
            raise ProviderUnavailable("the kernel has no RDMA support (ibv_get_device_list: "
                                      "ENOSYS; no ib_uverbs / CONFIG_INFINIBAND)") from None
        raise ProviderUnavailable(f"libibverbs lists no devices: {e}") from None
    for d in found:
        for p in d.get("ports", ()):
            p["gids"] = [(i, g, gid_type(d["name"], p["port"], i)) for i, g in p["gids"]]
    return found


def _best_gid(gids: list) -> int:
    """Prefer a RoCE v2 IPv4-mapped GID (routable, what rxe and most NICs use), then
    any RoCE v2 one, then the first non-zero GID (InfiniBand: index 0)."""
    v4 = bytes(10) + b"\xff\xff"
    for want in (lambda g, t: t == "RoCE v2" and g[:12] == v4, lambda g, t: t == "RoCE v2",
                 lambda g, t: True):
        for i, g, t in gids:
            if want(g, t):
                return i
    return 0


def candidates(device: str = "", port: int = 0,
               gid_index: int = -1) -> tuple[list[tuple[dict, dict, int]], list[str]]:
    """The active ports the settings allow, as (device, port, gid index) with the
    probe's dicts, in order, and why each other one is not usable."""
    found = devices()
    if not found:
        raise ProviderUnavailable("no RDMA device found (no driver loaded, or no rxe/siw "
                                  "link: `rdma link add rxe0 type rxe netdev eth0`)")
    out, why = [], []
    for d in found:
        if device and d["name"] != device:
            continue
        if "error" in d:
            why.append(f"{d['name']}: {d['error']}")
            continue
        for p in d["ports"]:
            if port and p["port"] != port:
                continue
            if not p["active"]:
                why.append(f"{d['name']} port {p['port']} is not active")
                continue
            if not p["gids"] and gid_index < 0:
                why.append(f"{d['name']} port {p['port']} has no GID")
                continue
            out.append((d, p, gid_index if gid_index >= 0 else _best_gid(p["gids"])))
    if device and not out and not why:
        names = ", ".join(d["name"] for d in found)
        raise ProviderUnavailable(f"no RDMA device {device!r} (found: {names})")
    return out, why


def choose(device: str = "", port: int = 0, gid_index: int = -1) -> tuple[str, int, int]:
    """(device, port, gid index) to use: the named ones, else the first active port."""
    found, why = candidates(device, port, gid_index)
    if not found:
        raise ProviderUnavailable("no usable RDMA port: " + "; ".join(why))
    d, p, gid = found[0]
    return d["name"], p["port"], gid


def status() -> tuple[bool, str]:
    """(usable, reason or the choice) for `rdmamw info` and the tests."""
    try:
        name, port, gid = choose(config.get("RDMAMW_VERBS_DEVICE"),
                                 config.get("RDMAMW_VERBS_PORT"),
                                 config.get("RDMAMW_VERBS_GID_INDEX"))
    except ProviderUnavailable as e:
        return False, str(e)
    return True, f"{name} port {port} GID index {gid}"


def require() -> None:
    ok, why = status()
    if not ok:
        raise ProviderUnavailable(f"verbs:// is unavailable here: {why}")
