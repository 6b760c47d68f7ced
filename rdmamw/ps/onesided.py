"""The one-sided pull (docs/ps.md, "One-sided pull"): a worker READs the server's shard
and its header instead of asking for them, so a pull costs the server's CPU nothing.

The server exposes, to each worker ("r"), a 64-byte header (word 0 a seqlock counter,
1 the model version, 2 the gradients merged) and each key's array, and hands the
references out once, in its replies (:class:`ExposedShard`). Every change of the shard
is bracketed by the header's counter turning odd and back to even (rdmamw/ps/_seqlock.pyx).
A worker (:class:`ShardReader`) reads the header, the keys, the header again, and keeps
what it read only if the counter was even and did not change: never a torn shard. After
``tries`` torn attempts it gives up and the worker pulls two-sided (counted).

The references come from the server, and a buggy or hostile one may send anything.
What cannot be a set of references (not one, a header of another size, two keys or a
key and the header naming one region, regions of two channels) is a ProtocolError when
it arrives, and nothing of it is taken. What shows only when it is used (a region of
another size than the key's array, a reference of another channel or job, one the owner
refuses: forged key, outside its exposure, not readable) makes the reader give up that
server's references, counted (``refused``): the pull, and every later one from that
server, goes two-sided. The owner's provider checks every access against its exposure
table, so nothing outside what it exposed is read; a pull never takes longer than the
worker's timeout (Timeout)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from rdmamw import config
from rdmamw.channel import Channel
from rdmamw.channel.remote import R, Region, RegionRef
from rdmamw.errors import (
    ProtocolError,
    ProviderUnavailable,
    RegionRevoked,
    RemoteAccessError,
    Timeout,
)
from rdmamw.ps import _seqlock

log = logging.getLogger("rdmamw.ps")

#: header words: the seqlock counter, the model version, the gradients merged (the rest
#: of the 64 bytes reserved)
HEADER_WORDS = 8
#: bytes per READ of a key: below the shm provider's smallest assisted copy (an assisted
#: copy would take the owner's CPU, which a one-sided pull must not)
PIECE = 256 << 10


def pull_mode(pull: str | None) -> str:
    """``pull``, or RDMAMW_PS_PULL when None; ValueError if it is neither way."""
    if pull is None:
        return str(config.get("RDMAMW_PS_PULL"))
    ways = config.setting("RDMAMW_PS_PULL").choices
    if pull not in ways:
        raise ValueError(f"pull must be one of {', '.join(ways)}, not {pull!r}")
    return pull


def one_sided_refusal(mode: str, dc: float, scheduled: bool = False) -> str | None:
    """Why a server cannot be pulled one-sided (None: it can). Only ASP without delay
    compensation or a scheduler: every other model decides when a worker may read
    (BSP, LSP, ALSP, hybrid wait for a round, SSP for the slowest worker's clock),
    delay compensation needs the copy of the model each worker read, and DSANA's plan
    rides on the pull replies."""
    if mode != "asp":
        return (f"consistency {mode!r} decides when a worker may read (the server's "
                f"decision); only 'asp' lets a worker read the shard whenever it wants")
    if scheduled:
        return "a DSANA scheduler's plan reaches the workers in the pull replies"
    if dc > 0:
        return ("delay compensation needs the model each worker read, which the server "
                "does not see in a one-sided pull")
    return None


class ExposedShard:
    """The server's side: the header and each key's array exposed "r" to every worker,
    the references not yet sent to each, and the seqlock around every change: ``with
    shard:`` (nested ones count as the outermost) brackets a change; at its end the
    header takes ``state()`` = (model version, gradients merged)."""

    def __init__(self, chans: dict[int, Channel], state: Callable[[], tuple[int, int]]
                 ) -> None:
        self.chans, self.state = chans, state
        self._depth = 0
        self.header = np.zeros(HEADER_WORDS, np.uint64)
        self.regions: dict[int, dict[Any, Region]] = {w: {} for w in chans}
        self.header_of: dict[int, Region | None] = {}
        self.unsent: dict[int, list[Any]] = {w: [] for w in chans}
        self.refused = 0        # exposures a provider would not make (those pulls: two-sided)
        for w in chans:
            self.header_of[w] = self._expose(w, self.header)

    def _expose(self, w: int, buf: np.ndarray) -> Region | None:
        try:
            return self.chans[w].expose(buf, access="r")
        except ProviderUnavailable as e:
            self.refused += 1
            log.warning("rdmamw.ps: worker %d: no one-sided pull (%s)", w, e)
            return None

    def add(self, key: Hashable, array: np.ndarray) -> None:
        """A new key: exposed to every worker whose header is (empty arrays need none)."""
        for w, hdr in self.header_of.items():
            if hdr is not None and not hdr.revoked:
                self._add(w, key, array)

    def _add(self, w: int, key: Hashable, array: np.ndarray) -> None:
        if array.nbytes:
            region = self._expose(w, array)
            if region is None:
                return
            self.regions[w][key] = region
        self.unsent[w].append(key)

    def attach(self, w: int, arrays: dict[Any, np.ndarray]) -> None:
        """Worker ``w`` joined on a new channel (``chans[w]``): the header and every key
        exposed to it, their references due in its next reply."""
        self.forget(w)
        self.header_of[w] = self._expose(w, self.header)
        if self.header_of[w] is not None:
            for key, array in arrays.items():
                self._add(w, key, array)

    def __enter__(self) -> None:
        self._depth += 1
        if self._depth == 1:
            _seqlock.begin(self.header)

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            _seqlock.end(self.header, *self.state())

    def offer(self, w: int) -> dict[str, Any]:
        """Reply fields with the references worker ``w`` has not had yet: ``rm`` =
        [header reference, [[key, reference or None (an empty key)], ...]]."""
        hdr = self.header_of.get(w)
        keys, self.unsent[w] = self.unsent.get(w, []), []
        if hdr is None or hdr.revoked or not keys:
            return {}
        refs = self.regions[w]
        return {"rm": [bytes(hdr.ref),
                       [[k, bytes(refs[k].ref) if k in refs else None] for k in keys]]}

    def forget(self, w: int) -> None:
        """Worker ``w`` is done or lost: its regions revoked."""
        for region in [self.header_of.get(w), *self.regions.get(w, {}).values()]:
            if region is not None:
                try:
                    region.revoke()
                except Exception as e:  # noqa: BLE001 - a closed channel revoked it already
                    log.debug("rdmamw.ps: worker %d: revoke: %s", w, e)
        self.header_of[w], self.regions[w], self.unsent[w] = None, {}, []


class ShardReader:
    """A worker's one-sided view of one server's shard: the references it was given,
    and the reads (header, keys, header) that make a whole shard or nothing."""

    def __init__(self, ch: Channel) -> None:
        self.ch = ch
        self.header: RegionRef | None = None
        self.refs: dict[Hashable, RegionRef | None] = {}
        self._h0 = np.zeros(3, np.uint64)
        self._h1 = np.zeros(3, np.uint64)
        self.torn = 0           # attempts thrown away: the shard changed under the read
        self.refused = 0        # times this server's references were given up as bad
        self.why: str | None = None     # the last reason they were

    def take(self, rm: Any) -> None:
        """The ``rm`` field of a server reply, all of it or nothing (ProtocolError for
        what cannot be this server's references, see the module doc)."""
        try:
            header = RegionRef.from_bytes(rm[0])
            refs = {k: None if ref is None else RegionRef.from_bytes(ref) for k, ref in rm[1]}
        except RemoteAccessError as e:
            raise ProtocolError(f"server reply: a bad region reference ({e})") from None
        if header.length != HEADER_WORDS * 8 or not header.access & R:
            raise ProtocolError(f"server reply: a shard header region of {header.length} "
                                f"bytes (access {header.access}); it is {HEADER_WORDS * 8}, "
                                f"readable")
        held = {k: r for k, r in self.refs.items() if k not in refs}
        seen = {(header.key, header.tag): "the header"}
        for k, r in [*held.items(), *refs.items()]:
            if r is None:
                continue
            if r.channel != header.channel:
                raise ProtocolError(f"server reply: key {k!r}'s region is on another "
                                    f"channel than the shard header's")
            other = seen.setdefault((r.key, r.tag), f"key {k!r}")
            if other != f"key {k!r}":
                raise ProtocolError(f"server reply: key {k!r}'s region reference names "
                                    f"the region of {other}")
        self.header = header
        self.refs.update(refs)

    def has(self, keys: list[Hashable]) -> bool:
        return self.header is not None and all(k in self.refs for k in keys)

    def read(self, keys: list[Hashable], dest: dict[Hashable, np.ndarray], tries: int,
             deadline: float | None = None) -> dict[str, int] | None:
        """Read ``keys`` into ``dest`` (key -> flat array) whole: {"version", "merged"}
        of the state read, or None (``dest`` then holds garbage: the caller pulls
        two-sided) after ``tries`` attempts that each overlapped a change, or when the
        references turned out bad (given up, counted). Timeout once ``deadline``
        (time.monotonic()) passed."""
        try:
            return self._read(keys, dest, tries, deadline)
        except RegionRevoked as e:  # the server let this worker go (or never exposed it)
            self._give_up(e, count=False)
        except RemoteAccessError as e:   # another channel's, outside it, not readable
            self._give_up(e)
        except _Mismatch as e:
            self._give_up(e)
        return None

    def _give_up(self, e: Exception, count: bool = True) -> None:
        """No more one-sided pulls from this server (its two-sided pulls go on)."""
        if count:
            self.refused += 1
            log.warning("rdmamw.ps: a server's region references refused (%s); pulling "
                        "two-sided from it", e)
        self.why = f"{type(e).__name__}: {e}"
        self.header, self.refs = None, {}

    def _read(self, keys: list[Hashable], dest: dict[Hashable, np.ndarray], tries: int,
              deadline: float | None) -> dict[str, int] | None:
        assert self.header is not None
        for k in keys:
            ref, size = self.refs[k], dest[k].nbytes
            if (0 if ref is None else ref.length) != size:
                raise _Mismatch(f"key {k!r}: a region of {0 if ref is None else ref.length} "
                                f"bytes for an array of {size}")

        def left() -> float | None:
            if deadline is None:
                return None
            t = deadline - time.monotonic()
            if t <= 0:
                raise Timeout(f"one-sided pull: no whole read of the shard within the "
                              f"timeout ({self.torn} torn so far)")
            return t

        h0, h1 = self._h0, self._h1
        for _ in range(tries):
            self.ch.read(self.header, h0, timeout=left()).wait()
            if int(h0[0]) & 1:              # being changed now: not worth reading
                self.torn += 1
                time.sleep(0)               # let the server (maybe on this core) finish
                continue
            ops = self.ch.batch()
            for k in keys:
                ref, flat = self.refs[k], dest[k]
                if ref is None:
                    continue
                step = max(1, PIECE // flat.itemsize)
                for o in range(0, flat.size, step):
                    ops.read(ref, flat[o:o + step], o * flat.itemsize)
            ops.post(left()).wait()
            self.ch.read(self.header, h1, timeout=left()).wait()
            if h1[0] == h0[0]:
                return {"version": int(h0[1]), "merged": int(h0[2])}
            self.torn += 1
        return None


class _Mismatch(Exception):
    """A reference that cannot be the key's: given up before anything is read."""
