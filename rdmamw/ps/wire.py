"""The parameter server's messages: a small msgpack header, then (for data) one raw
payload message of at most the channel's eager limit, so big tensors go as blocks
and the receiver reads each block straight from the ring."""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterator
from typing import Any

import msgpack
import numpy as np

from rdmamw.errors import ProtocolError

#: header ops. worker -> server: INIT (+payload), SYNC, GRAD (+payload), CLOCK, PULL,
#: BYE (acknowledged with OK). server -> worker: OK, VAL (+payload), END (a pull is complete), ERR.
INIT, SYNC, GRAD, CLOCK, PULL, BYE = "init", "sync", "grad", "clock", "pull", "bye"
OK, VAL, END, ERR = "ok", "val", "end", "err"
WITH_PAYLOAD = (INIT, GRAD, VAL)
REQUESTS = (INIT, SYNC, GRAD, CLOCK, PULL, BYE)
#: what a key may be: msgpack's hashable scalars (a list or a map comes back unhashable)
KEY_TYPES = (str, bytes, int, float, bool, type(None))
#: dtype kinds a key may hold (bool, integers, floats, complex; no objects, records,
#: strings or times), and those a gradient may be pushed to (SGD's arithmetic)
VALUE_KINDS, GRADIENT_KINDS = "biufc", "fc"
MAX_DIMS = 32
MAX_SECONDS = 1e6       # a reported compute time (the models divide and ceil by them)
MAX_SAMPLES = 1 << 53


class BadRequest(ProtocolError):
    """A worker's request the server cannot take: its header is not msgpack, not a
    map, of an unknown op, or a field is missing or of the wrong type or range (or its
    payload does not fit the header). The server answers it with ERR and serves on;
    ``payload``: a payload message follows the refused header (skipped, not read as
    the next request); ``key``: the key it named, when one could be read."""

    def __init__(self, text: str, *, payload: bool = False, key: Any = None) -> None:
        super().__init__(text)
        self.payload, self.key = payload, key


def pack(op: str, **fields: object) -> bytes:
    fields["op"] = op
    return msgpack.packb(fields, use_bin_type=True)


def unpack(msg: object) -> dict:
    return msgpack.unpackb(memoryview(msg), raw=False, strict_map_key=False)  # type: ignore[arg-type]


def _int(h: dict, name: str, lo: int = 0, hi: int = 1 << 64, *, required: bool = False,
         none: bool = False, payload: bool = False) -> None:
    """Check field ``name``: an integer in [lo, hi]; absent only if not ``required``,
    None only if ``none`` (the server reads it as absent)."""
    if name not in h and not required or none and h.get(name) is None:
        return
    v = h.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise BadRequest(f"field {name!r} = {v!r:.60} is not an integer in [{lo}, {hi}]",
                         payload=payload, key=_key_or_none(h.get("k")))


def _key_or_none(k: Any) -> Any:
    return k if type(k) in KEY_TYPES else None


def _key(h: dict, name: str, payload: bool = False) -> Any:
    k = h.get(name)
    if type(k) not in KEY_TYPES or name not in h:
        raise BadRequest(f"field {name!r} = {k!r:.60} is not a key (a string, bytes or a "
                         f"number)", payload=payload)
    return k


def dtype(text: Any, kinds: str = VALUE_KINDS, *, payload: bool = False,
          key: Any = None) -> np.dtype:
    """The dtype a header names, if a key may hold it; else BadRequest."""
    try:
        dt = np.dtype(text) if isinstance(text, str) else None
    except (TypeError, ValueError, SyntaxError):
        dt = None
    if dt is None or dt.kind not in kinds or dt.hasobject or dt.itemsize == 0 \
            or dt.fields is not None or dt.subdtype is not None:
        raise BadRequest(f"dtype {text!r:.60} is not one of kinds {kinds!r} (bool, int, "
                         f"float, complex)", payload=payload, key=key)
    return dt


def request(msg: object) -> dict:
    """A worker's header, decoded and checked: a map with a known ``op`` and each field
    that op reads of the type and range the server uses (extra fields are ignored);
    else BadRequest. ``dt`` comes back as a numpy dtype, ``shape`` as a tuple."""
    try:
        h = unpack(msg)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise BadRequest(f"header is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(h, dict):
        raise BadRequest(f"header {h!r:.60} is not a map")
    op = h.get("op")
    if type(op) is not str or op not in REQUESTS:
        raise BadRequest(f"unknown request {op!r:.60}")
    payload = op in WITH_PAYLOAD
    if payload:
        key = _key(h, "k", payload)
        _int(h, "o", payload=payload)
        kinds = VALUE_KINDS if op == INIT else GRADIENT_KINDS
        h["dt"] = dtype(h.get("dt"), kinds, payload=True, key=key)
        if op == INIT:
            shape = h.get("shape")
            if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
                    and all(type(d) is int and 0 <= d < 1 << 62 for d in shape)):
                raise BadRequest(f"key {key!r}: shape {shape!r:.60} is not a list of at most "
                                 f"{MAX_DIMS} sizes >= 0", payload=True, key=key)
            if math.prod(shape) * h["dt"].itemsize >= 1 << 62:
                raise BadRequest(f"key {key!r}: shape {shape} is too large", payload=True,
                                 key=key)
            h["shape"] = tuple(shape)
    elif op == SYNC:
        _int(h, "id", -(1 << 63), required=True)
    elif op == PULL:
        _int(h, "id", -(1 << 63), required=True)
        keys = h.get("keys")
        if not (isinstance(keys, list) and all(type(k) in KEY_TYPES for k in keys)):
            raise BadRequest(f"field 'keys' = {keys!r:.60} is not a list of keys (strings, "
                             f"bytes or numbers)")
    elif op == BYE:
        _int(h, "id", -(1 << 63))
    elif op == CLOCK:
        _int(h, "base", -(1 << 63))
        _int(h, "n", 0, MAX_SAMPLES, none=True)
        t = h.get("t")
        if t is not None and not (type(t) in (int, float) and math.isfinite(t)
                                  and 0 <= t <= MAX_SECONDS):
            raise BadRequest(f"field 't' = {t!r:.60} is not a time in [0, {MAX_SECONDS:g}] s")
    return h


def reply(msg: object) -> dict:
    """A server's header as a worker reads it, checked (ProtocolError otherwise): a
    map with a reply op and the fields the worker uses of the right types."""
    try:
        h = unpack(msg)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(f"server reply is not msgpack ({type(e).__name__}: {e})") from None
    op = h.get("op") if isinstance(h, dict) else None
    ints = [h.get("id"), h.get("version"), h.get("merged", 0)] if op in (OK, END) else []
    plan, shares = (h.get("plan"), h.get("shares")) if op in (OK, END) else (None, None)
    rm = h.get("rm") if op in (OK, END) else None
    ok = (op == VAL and type(h.get("k")) in KEY_TYPES and type(h.get("o", 0)) is int
          and h.get("o", 0) >= 0
          or op == ERR and isinstance(h.get("msg"), str)
          or op in (OK, END) and all(type(v) is int for v in ints)
          and (plan is None or isinstance(plan, list) and len(plan) == 3
               and all(type(v) is int for v in plan))
          and (shares is None or isinstance(shares, list)
               and all(type(v) is int for v in shares))
          and (rm is None or _region_refs(rm)))
    if not ok:
        raise ProtocolError(f"server reply {h!r:.80} is not a well-formed "
                            f"ok / val / end / err")
    return h


def _region_refs(rm: Any) -> bool:
    """Whether ``rm`` is a reply's region references (rdmamw/ps/onesided.py): [header
    reference, [[key, reference or None], ...]], references as bytes."""
    return (isinstance(rm, list) and len(rm) == 2 and isinstance(rm[0], bytes)
            and isinstance(rm[1], list)
            and all(isinstance(p, list) and len(p) == 2 and type(p[0]) in KEY_TYPES
                    and (p[1] is None or isinstance(p[1], bytes)) for p in rm[1]))


def shard(key: Hashable, nservers: int) -> int:
    """The server that owns ``key``: stable across processes (not Python's hash)."""
    return zlib.crc32(repr(key).encode()) % nservers


def blocks(flat: np.ndarray, limit: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset in elements, block) pieces of a 1-D array, each at most ``limit`` bytes."""
    step = max(1, limit // flat.itemsize)
    for o in range(0, max(flat.size, 1), step):
        yield o, flat[o:o + step]
