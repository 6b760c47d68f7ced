"""Who may connect over shm, and what a peer's descriptors must be (issue 13, finding 3):
only our own user (others by ``RDMAMW_SHM_ALLOW_UIDS``), root included; every memfd is
sealed against resizing, so a peer cannot truncate a block under us (SIGBUS); a peer's
descriptors are checked before anything is mapped."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import tempfile
import threading

import msgpack
import numpy as np
import pytest

from rdmamw.errors import ConfigError, ProtocolError, Timeout
from rdmamw.providers.shm import provider as shm
from rdmamw.transport import layout
from rdmamw.transport import wire as fr
from tests.support import hooks
from tests.support.helpers import unique_name

NOBODY = 65534
STAGE = 1 << 20


def _memfd(size: int, seals: int | None = shm.SEALS) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _hostile_open(conn: socket.socket, *, block=None, evfd=None, stage=None,
                  size_delta: int = 0) -> list[int]:
    """The opener's half of the shm handshake, by hand, with the descriptors given (an
    honest sealed one where None); it claims it cannot CMA the acceptor and offers no
    probe word, so both staging areas are exchanged. Returns the descriptors the
    acceptor sent (block, eventfd, and its staging area if it got that far)."""
    fr.send_frame(conn, {"v": fr.PROTOCOL_VERSION, "slots": 8, "slot_size": 4096,
                         "pid": os.getpid(), "mode": "batched"})
    peer = fr.recv_frame(conn)
    total = layout.endpoint_layout(8, 4096, peer["slots"]).total + shm.XTAB_SPACE
    fds = [block if block is not None else _memfd(total),
           evfd if evfd is not None else os.eventfd(0, os.EFD_NONBLOCK)]
    stage = stage if stage is not None else _memfd(STAGE)
    socket.send_fds(conn, [msgpack.packb({"size": total + size_delta})], fds)
    _data, theirs, _f, _a = socket.recv_fds(conn, fr.MAX_HELLO, 2)
    for fd in fds:
        os.close(fd)
    try:
        fr.recv_frame(conn)                                 # the acceptor's probe word
        fr.send_frame(conn, {"probe": 0})                   # ... and no word of ours
        fr.recv_frame(conn)
        fr.send_frame(conn, {"cma": False})
        _data, staged, _f, _a = socket.recv_fds(conn, fr.MAX_HELLO, 1)
        theirs += staged
        socket.send_fds(conn, [msgpack.packb({"stage": STAGE})], [stage])
    except (OSError, ProtocolError):
        pass                                                # refused before that
    finally:
        os.close(stage)
    return theirs


def _accept_with(**hostile) -> tuple[BaseException | None, list[int]]:
    """Run the acceptor's handshake against a hand-made opener; (what the acceptor
    raised, the descriptors it handed over)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    out: dict = {}

    def acceptor():
        try:
            out["conn"] = shm._handshake(a, unique_name("trust"), 8, 4096, None, os.getpid())
        except BaseException as e:       # noqa: BLE001 (the test inspects it)
            out["error"] = e

    t = threading.Thread(target=acceptor)
    t.start()
    try:
        theirs = _hostile_open(b, **hostile)
    finally:
        b.close()
        t.join(10)
    if "conn" in out:
        out["conn"].transport.close()
    return out.get("error"), theirs


@pytest.mark.parametrize("what", ["block", "stage"])
def test_an_unsealed_memfd_is_refused_before_it_is_mapped(what):
    error, theirs = _accept_with(**{what: _memfd(1 << 20 if what == "block" else STAGE,
                                                 seals=None)})
    for fd in theirs:
        os.close(fd)
    assert isinstance(error, ProtocolError), error
    assert "sealed" in str(error)


def test_a_memfd_that_may_still_shrink_is_refused():
    error, theirs = _accept_with(stage=_memfd(STAGE, seals=fcntl.F_SEAL_GROW))
    for fd in theirs:
        os.close(fd)
    assert isinstance(error, ProtocolError) and "sealed" in str(error), error


def test_a_regular_file_as_block_is_refused():
    with tempfile.TemporaryFile() as f:
        os.ftruncate(f.fileno(), 1 << 20)
        error, theirs = _accept_with(block=os.dup(f.fileno()))
    for fd in theirs:
        os.close(fd)
    assert isinstance(error, ProtocolError), error


def test_a_pipe_as_eventfd_is_refused():
    r, w = os.pipe()
    os.close(r)
    error, theirs = _accept_with(evfd=w)
    for fd in theirs:
        os.close(fd)
    assert isinstance(error, ProtocolError) and "eventfd" in str(error), error


def test_a_block_smaller_than_announced_is_refused():
    error, theirs = _accept_with(size_delta=-4096)
    for fd in theirs:
        os.close(fd)
    assert isinstance(error, ProtocolError), error


def test_our_memfds_cannot_be_resized_by_the_peer():
    """What we hand over is sealed: the peer's ftruncate fails, so it can never make
    our mapping of it raise SIGBUS."""
    _error, theirs = _accept_with()
    try:
        assert len(theirs) == 3
        for fd in (theirs[0], theirs[2]):
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & shm.SEALS == shm.SEALS
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, os.fstat(fd).st_size + 4096)
    finally:
        for fd in theirs:
            os.close(fd)


def test_allowed_uids_setting(monkeypatch):
    monkeypatch.setenv("RDMAMW_SHM_ALLOW_UIDS", "1000, 1001")
    assert shm.allowed_uids() == frozenset({1000, 1001})
    monkeypatch.setenv("RDMAMW_SHM_ALLOW_UIDS", "any")
    assert shm.allowed_uids() is None
    monkeypatch.setenv("RDMAMW_SHM_ALLOW_UIDS", "")
    assert shm.allowed_uids() == frozenset()
    for bad in ("root", "-1", "1000;1001"):
        monkeypatch.setenv("RDMAMW_SHM_ALLOW_UIDS", bad)
        with pytest.raises(ConfigError, match="RDMAMW_SHM_ALLOW_UIDS"):
            shm.allowed_uids()


# ---- another user (needs root to become one) ------------------------------------------

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a peer as "
                                "another user")


def _as_nobody(fn) -> int:
    """Run fn() in a forked child as uid 65534; its exit status (0: fn returned True)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 0 if fn() else 1
        except BaseException:           # noqa: BLE001 (the exit status says it)
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@needs_root
def test_a_root_listener_refuses_a_peer_of_another_user(caplog):
    """Refused, logged and dropped: the listener's accept() is not failed by it."""
    caplog.set_level(logging.WARNING, logger="rdmamw.shm")
    name = unique_name("uid")
    lst = shm.listen(name, slots=8, slot_size=4096)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("status", _as_nobody(
        lambda: shm.connect(name, mode="batched", timeout=5, slots=8, slot_size=4096))))
    t.start()
    try:
        with pytest.raises(Timeout):
            lst.accept(timeout=3)
    finally:
        t.join(20)
        lst.close()
    assert result["status"] == 2        # the child's connect failed too
    assert [r.getMessage() for r in caplog.records if f"uid {NOBODY}" in r.getMessage()
            and "dropped" in r.getMessage()], [r.getMessage() for r in caplog.records]


@needs_root
def test_an_allowed_other_user_connects_but_gets_no_help_and_nothing_unexposed(
        monkeypatch):
    """With RDMAMW_SHM_ALLOW_UIDS the uid-65534 child connects. Root may CMA it, it may
    not CMA root. The child plays finding 1's attack (a forged entry in root's table
    mirror, an assist job on root's secret): root, idle, copies nothing."""
    monkeypatch.setenv("RDMAMW_SHM_ALLOW_UIDS", str(NOBODY))
    name = unique_name("uid")
    secret = np.zeros(1 << 20, np.uint8)
    addr = secret.__array_interface__["data"][0]
    to_root, from_child = os.pipe()
    to_child, from_root = os.pipe()

    def child():
        os.environ["RDMAMW_SHM_ALLOW_UIDS"] = "0"     # both sides must let the other in
        tp = shm.connect(name, mode="batched", timeout=10, slots=8, slot_size=4096).transport
        dst = np.zeros(1 << 20, np.uint8)
        key = (1 << 8) | 7
        hooks.forge_peer_xtab(tp, 7, 0, (1 << 64) - 1, key, 3)
        hooks.offer_job(tp, addr, dst.__array_interface__["data"][0], 1 << 20, 1 << 18, key, 4)
        os.write(from_child, bytes([tp.cma_modes[0], tp.cma_modes[1]]))
        os.read(to_child, 1)
        ok = not dst.any()
        tp.close()
        return ok

    lst = shm.listen(name, slots=8, slot_size=4096)
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("status", _as_nobody(child)))
    t.start()
    try:
        tp = lst.accept(timeout=10).transport
        secret[:] = 0x5E                    # after the fork: only root's copy has it
        child_modes = os.read(to_root, 2)
        did = hooks.assist_now(tp)
        os.write(from_root, b"x")
        tp.close()
    finally:
        t.join(30)
        lst.close()
        for fd in (to_root, from_child, to_child, from_root):
            os.close(fd)
    assert tp.cma_modes == (True, False)          # root reads the child, not the reverse
    assert child_modes == bytes([0, 1])
    assert did == 0
    assert result["status"] == 0                  # the child's buffer stayed zero
