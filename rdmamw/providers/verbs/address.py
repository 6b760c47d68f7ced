"""``verbs://HOST:PORT?opt=v`` addresses: the host, the port and the options (each
overriding the setting of the same name), checked; shared by the provider and the
rank descriptors (rank.py)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qsl

from rdmamw import config

#: address option -> the setting it overrides (defaults and docs: settings.py)
OPTIONS = {
    "device": "RDMAMW_VERBS_DEVICE",
    "port": "RDMAMW_VERBS_PORT",
    "gid_index": "RDMAMW_VERBS_GID_INDEX",
    "sq_depth": "RDMAMW_VERBS_SQ_DEPTH",
    "rq_depth": "RDMAMW_VERBS_RQ_DEPTH",
    "inline": "RDMAMW_VERBS_INLINE",
    "event": "RDMAMW_VERBS_EVENT",
    "poll_ms": "RDMAMW_VERBS_POLL_MS",
    "timeout": "RDMAMW_VERBS_TIMEOUT",
    "ring_start": "RDMAMW_VERBS_RING_START",
    "windows": "RDMAMW_VERBS_WINDOWS",
    "read_chunk": "RDMAMW_VERBS_READ_CHUNK",
}


@dataclass(frozen=True)
class Where:
    host: str
    port: int
    opts: dict


def parse_where(where: str) -> Where:
    """``"HOST:PORT?opt=v"`` -> Where; IPv6 hosts in brackets."""
    hostport, _, query = where.partition("?")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"verbs address {where!r} is not HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    opts = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in OPTIONS:
            raise ValueError(f"unknown verbs option {key!r}; known: {', '.join(OPTIONS)}")
        opts[key] = value
    for key, name in OPTIONS.items():
        if key not in opts:
            opts[key] = config.get(name)
    for key in OPTIONS:
        if key == "read_chunk":     # bytes: "512K" as in the setting, checked the same
            value = opts[key]
            value = config.setting(OPTIONS[key]).parse(value) if isinstance(value, str) \
                else value
            opts[key] = -1 if value is None else value  # -1: the device's default
        elif key != "device":
            try:
                opts[key] = int(opts[key])
            except ValueError:
                raise ValueError(f"verbs option {key}={opts[key]!r} is not an integer") from None
    return Where(host, int(port), opts)
