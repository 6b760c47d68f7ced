"""RDMA device discovery with pyverbs, for `rdmamw info`: devices, ports, GIDs and
whether each port can carry verbs:// (and why not). pyverbs is optional (Debian's
python3-pyverbs, linked into the venv by scripts/pyverbs-link.sh)."""

from __future__ import annotations

from rdmamw.providers.verbs.probe import gid_type

PORT_STATES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def _gid_bytes(gid) -> bytes:
    return bytes.fromhex(str(gid).replace(":", ""))


def describe(max_gids: int = 16) -> list[str]:
    """Human-readable lines; never raises."""
    try:
        import pyverbs.device as pd
    except ImportError as e:
        return [f"pyverbs not importable ({e}): apt-get install python3-pyverbs, then "
                f"scripts/pyverbs-link.sh"]
    try:
        devs = pd.get_device_list()
    except Exception as e:  # noqa: BLE001 - pyverbs raises its own error types
        return [f"no RDMA devices: {e}"]
    if not devs:
        return ["no RDMA devices (no driver loaded, or no rxe/siw link)"]
    lines = []
    for d in devs:
        name = d.name.decode()
        try:
            with pd.Context(name=name) as ctx:
                attr = ctx.query_device()
                lines.append(f"{name}: {attr.phys_port_cnt} port(s), max_qp_wr {attr.max_qp_wr}")
                for p in range(1, attr.phys_port_cnt + 1):
                    lines += _port(ctx, name, p, max_gids)
        except Exception as e:  # noqa: BLE001
            lines.append(f"{name}: cannot open ({e})")
    return lines


def _port(ctx, name: str, p: int, max_gids: int) -> list[str]:
    pa = ctx.query_port(p)
    gids = []
    for i in range(min(pa.gid_tbl_len, max_gids)):
        try:
            g = _gid_bytes(ctx.query_gid(p, i))
        except Exception:  # noqa: BLE001 - an empty entry
            continue
        if any(g):
            gids.append(f"[{i}] {ctx.query_gid(p, i)} {gid_type(name, p, i) or '?'}")
    state = PORT_STATES.get(pa.state, str(pa.state))
    usable = "usable" if pa.state == 4 and gids else (
        "not usable: port not ACTIVE" if pa.state != 4 else "not usable: no GID")
    out = [f"  port {p}: {state}, {LINK_LAYERS.get(pa.link_layer, pa.link_layer)}, "
           f"mtu {MTUS.get(pa.active_mtu, pa.active_mtu)}, lid {pa.lid}: {usable}"]
    out += [f"    gid {g}" for g in gids]
    return out
