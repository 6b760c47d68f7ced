"""The one-sided pull (docs/ps.md, "One-sided pull"): a worker READs the server's shard
and its header instead of asking for them, so a pull costs the server's CPU nothing.

The server exposes, to each worker ("r"), a 64-byte header (word 0 a seqlock counter,
1 the model version, 2 the gradients merged) and each key's array, and hands the
references out once, in its replies (:class:`ExposedShard`). Every change of the shard
is bracketed by the header's counter turning odd and back to even (rdmamw/ps/_seqlock.pyx).
A worker (:class:`ShardReader`) reads the header, the keys, the header again, and keeps
what it read only if the counter was even and did not change: never a torn shard. After
``tries`` torn attempts it gives up and the worker pulls two-sided (counted)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from rdmamw import config
from rdmamw.channel import Channel
from rdmamw.channel.remote import Region, RegionRef
from rdmamw.errors import ProtocolError, ProviderUnavailable, RegionRevoked, RemoteAccessError
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

    def take(self, rm: Any) -> None:
        """The ``rm`` field of a server reply (ProtocolError if it is not one)."""
        try:
            self.header = RegionRef.from_bytes(rm[0])
            for k, ref in rm[1]:
                self.refs[k] = None if ref is None else RegionRef.from_bytes(ref)
        except RemoteAccessError as e:
            raise ProtocolError(f"server reply: a bad region reference ({e})") from None

    def has(self, keys: list[Hashable]) -> bool:
        return self.header is not None and all(k in self.refs for k in keys)

    def read(self, keys: list[Hashable], dest: dict[Hashable, np.ndarray], tries: int
              ) -> dict[str, int] | None:
        """Read ``keys`` into ``dest`` (key -> flat array) whole: {"version", "merged"}
        of the state read, or None after ``tries`` attempts that each overlapped a
        change (``dest`` then holds garbage: the caller pulls two-sided)."""
        try:
            return self._read(keys, dest, tries)
        except RegionRevoked:       # the server let this worker go: pull two-sided
            self.header, self.refs = None, {}
            return None

    def _read(self, keys: list[Hashable], dest: dict[Hashable, np.ndarray], tries: int
              ) -> dict[str, int] | None:
        assert self.header is not None
        h0, h1 = self._h0, self._h1
        for _ in range(tries):
            self.ch.read(self.header, h0).wait()
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
            ops.post().wait()
            self.ch.read(self.header, h1).wait()
            if h1[0] == h0[0]:
                return {"version": int(h0[1]), "merged": int(h0[2])}
            self.torn += 1
        return None
