"""``rdmamw perf -t read|write|atomic``: one-sided remote memory, as perftest's
ib_read_* / ib_write_* / ib_atomic_*. The server exposes a buffer on the channel and
sends its reference; the client reads, writes or fetch-adds it in a loop (``--batch``
operations a ``ch.batch()`` chain) and checks the bytes at the end of each run; the
server keeps the exposure until the client says done, then revokes it, and the client
checks that a later access is refused. The server's side and the client's timed loops
are here; the parameters, the table and the command are ``perf``'s."""

from __future__ import annotations

import time
from typing import Any

import msgpack

from rdmamw.channel.remote import RegionRef
from rdmamw.errors import ProtocolError, ProviderUnavailable, RdmamwError, RegionRevoked
from rdmamw.memory.sharedmem import shared

#: the one-sided tests and the access each one's region is exposed with
ACCESS = {"read": "r", "write": "w", "atomic": "atomic"}
TESTS = tuple(ACCESS)
WORD = 8                 # an atomic's operand: one aligned 64-bit word
_PERIOD = bytes(range(251))    # a prime period: a shifted range never matches


def pattern(n: int, seed: int) -> bytearray:
    """``n`` bytes that start at ``seed`` in a period of 251 (the bytes a run checks),
    made in place by doubling: one allocation of ``n`` whatever the size, so that a
    client's largest size (1 GiB) costs the server one buffer, not several copies."""
    k = seed % 251
    out = bytearray(n)
    head = (_PERIOD[k:] + _PERIOD[:k])[:n]
    out[:len(head)] = head
    view, m = memoryview(out), len(head)
    while m < n:
        c = min(m, n - m)
        view[m:m + c] = view[:c]
        m += c
    return out


def message(ch: Any, timeout: float) -> dict[str, Any]:
    """The next message as a msgpack map; the other end's refusal as ProtocolError."""
    m = ch.recv(timeout=timeout)
    try:
        d = msgpack.unpackb(bytes(m))
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(f"perf: a message that is not msgpack: {e}") from None
    finally:
        m.release()
    if not isinstance(d, dict):
        raise ProtocolError(f"perf: {d!r:.80} is not a map")
    if "refused" in d:
        raise ProtocolError(f"perf: the other end refused: {d['refused']!s:.300}")
    return d


def refuse(ch: Any, error: BaseException) -> None:
    """Tell the other end why it is dropped (best effort: it may be gone already)."""
    try:
        ch.send(msgpack.packb({"refused": f"{type(error).__name__}: {error}"}), timeout=1)
    except RdmamwError:
        pass


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if type(v) is not int or v < 0:
        raise ProtocolError(f"perf: {key}={v!r:.40} in {d!r:.80} is not a count")
    return v


# ---- server ------------------------------------------------------------------------

def serve(ch: Any, test: str, sizes: list[int], phases: int, timeout: float) -> None:
    """Expose a buffer of the largest size (a word for atomic) and send its reference
    (or the provider's refusal); answer each of the client's ``phases`` end-of-run
    messages with what the buffer holds; revoke when the client says done."""
    # an atomic's word in memory the peer can map (shm's atomics need it)
    buf: Any = pattern(max(sizes), 0) if test == "read" else shared(WORD) \
        if test == "atomic" else bytearray(max(sizes))
    want = bytes(buf) if test == "read" else b""      # what every read check compares
    try:
        region = ch.expose(buf, ACCESS[test])
    except ProviderUnavailable as e:
        ch.send(msgpack.packb({"error": f"-t {test}: not on the {ch.provider} provider: {e}"}))
        return
    try:
        ch.send(msgpack.packb({"ref": bytes(region.ref)}))
        for _ in range(phases):
            d = message(ch, timeout)
            size, seed = _int(d, "size"), _int(d, "seed")
            if size > len(buf):
                raise ProtocolError(f"perf: size {size} beyond the exposed {len(buf)}")
            if test == "write":      # compared in place: no copy of the buffer
                ch.send(msgpack.packb({"ok": buf.startswith(pattern(size, seed))}))
            elif test == "atomic":
                ch.send(msgpack.packb({"word": int.from_bytes(buf, "little")}))
            else:
                ch.send(msgpack.packb({"ok": buf == want}))
        if message(ch, timeout).get("done") is not True:
            raise ProtocolError("perf: the client's last message is not done")
    finally:
        region.revoke()
    ch.send(msgpack.packb({"revoked": True, "exposed": ch.stats()["rmem_exposed"]}))


# ---- client ------------------------------------------------------------------------

def open_ref(ch: Any, timeout: float) -> RegionRef:
    """The server's reference, or its provider's refusal as ProviderUnavailable."""
    d = message(ch, timeout)
    if "error" in d:
        raise ProviderUnavailable(str(d["error"]))
    ref = d.get("ref")
    if not isinstance(ref, bytes):
        raise ProtocolError(f"perf: {d!r:.80} holds no region reference")
    return RegionRef.from_bytes(ref)


def _transfer(ch: Any, test: str, ref: RegionRef, local: bytearray, count: int,
              batch: int, timeout: float, times: list[float] | None) -> None:
    """``count`` READs into / WRITEs from ``local`` at offset 0, ``batch`` a chain."""
    clock = time.perf_counter_ns
    one = ch.read if test == "read" else ch.write
    done, last = 0, clock()
    while done < count:
        k = min(batch, count - done)
        if k == 1:
            if test == "read":
                one(ref, local, timeout=timeout).wait()
            else:
                one(local, ref, timeout=timeout).wait()
        else:
            ops = ch.batch()
            add = ops.read if test == "read" else ops.write
            for _ in range(k):
                if test == "read":
                    add(ref, local)
                else:
                    add(local, ref)
            ops.post(timeout=timeout).wait()
        done += k
        if times is not None:
            now = clock()
            times.append((now - last) / 1000 / k)     # microseconds per operation
            last = now


def _atomics(ch: Any, ref: RegionRef, count: int, start: int, timeout: float,
             times: list[float] | None) -> int:
    """``count`` fetch_add(1) on word 0, each checked against the count before it."""
    clock = time.perf_counter_ns
    for i in range(count):
        t0 = clock()
        old = ch.fetch_add(ref, 0, 1, timeout=timeout).wait()
        if times is not None:
            times.append((clock() - t0) / 1000)
        if old != start + i:
            raise ProtocolError(f"perf: fetch_add returned {old}, expected {start + i}")
    return start + count


def run(ch: Any, test: str, ref: RegionRef, size: int, count: int, batch: int, seed: int, word: int,
        timeout: float, times: list[float] | None) -> int:
    """One run (a warm-up or the timed one) and its check with the server: the read
    destination equals the server's pattern, the server's buffer holds what was
    written, the word counts every add. The atomic word after the run."""
    if test == "atomic":
        word = _atomics(ch, ref, count, word, timeout, times)
    else:
        local = pattern(size, seed) if test == "write" else bytearray(size)
        _transfer(ch, test, ref, local, count, batch, timeout, times)
        want = pattern(size, 0) if test == "read" else local
        if local != want:
            at = next(i for i, (a, b) in enumerate(zip(local, want, strict=True)) if a != b)
            raise ProtocolError(f"perf: read {size} B: byte {at} differs from the "
                                f"server's buffer")
    ch.send(msgpack.packb({"size": size, "seed": seed}))
    d = message(ch, timeout)
    if test == "atomic":
        if d.get("word") != word:
            raise ProtocolError(f"perf: the server's word is {d.get('word')!r}, "
                                f"expected {word} (one add per fetch_add)")
    elif d.get("ok") is not True:
        raise ProtocolError(f"perf: {test} {size} B: the server's buffer does not hold "
                            f"the bytes expected")
    return word


def finish(ch: Any, test: str, ref: RegionRef, timeout: float) -> None:
    """Say done; check the server revoked its exposure: an access is refused now."""
    ch.send(msgpack.packb({"done": True}))
    d = message(ch, timeout)
    if d.get("revoked") is not True or d.get("exposed") != 0:
        raise ProtocolError(f"perf: the server did not revoke its region ({d!r:.80})")
    try:
        if test == "read":
            ch.read(ref, bytearray(1), timeout=timeout).wait()
        elif test == "write":
            ch.write(b"\0", ref, timeout=timeout).wait()
        else:
            ch.fetch_add(ref, 0, 1, timeout=timeout).wait()
    except RegionRevoked:
        return
    raise ProtocolError("perf: the server's region is still accessible after its revoke")
