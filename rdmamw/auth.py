"""Shared-token authentication of every tcp connection (channels and the bootstrap
store): a mutual HMAC-SHA256 challenge-response, so the token never crosses the
wire and a replayed transcript is useless (both sides contribute a fresh nonce).

The token is ``RDMAMW_TOKEN`` if set, else the one ``rdmamw.init()`` installed, else
a per-user secret in ``~/.config/rdmamw/token`` (mode 0600, created on first use),
which is enough for processes of one user on one host or a shared home.

A job's channels by rank prove more than the token: the key is :func:`job_key` of the
job's id (rank 0 makes a fresh one for every job and hands it out through the store), so
a rank of another job, or of an earlier run of this one, fails the proof even with the
same token. The bootstrap sets it for the openers (:func:`keyed`) and for its listeners.

The bootstrap store refuses a wrong proof out loud (:data:`REFUSED` in place of its
own proof), so a joining rank can tell a wrong token from a rank 0 that hung up; the
channel listeners just hang up.

The listeners (rdmamw/listener.py) send the challenge and collect the
opener's proof in their accept loop, without a thread; the handshake thread then
finds both here (:func:`answered`) and ``accept_side`` only checks the proof."""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rdmamw import config
from rdmamw.errors import ConfigError, ProtocolError
from rdmamw.transport.wire import recv_exact

MAGIC = b"RDMW"
VERSION = 1
NONCE = 16
MAC = 32
HELLO_BYTES = len(MAGIC) + 1 + NONCE          # listener -> opener
PROOF_BYTES = HELLO_BYTES + MAC               # opener -> listener
#: what a listener sends in place of its proof when the opener's was wrong
REFUSED = b"RDMW refused: wrong token/job\0\0\0"
assert len(REFUSED) == MAC

_installed: bytes | None = None
_local = threading.local()      # .key (an opener's), .answer (a listener's, per thread)


class AuthError(ProtocolError):
    """The peer does not know the shared token (or spoke garbage)."""


class TokenRefused(AuthError):
    """The listener said our proof was wrong: it holds another token (or job)."""

    error_kind = "refused"


def set_token(token: str | bytes | None) -> None:
    """Use ``token`` for connections made from now on (``None``: back to the default)."""
    global _installed
    _installed = token.encode() if isinstance(token, str) else token


def _token_file() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "rdmamw", "token")


def token() -> bytes:
    """The shared token (see the module doc), or ConfigError saying how to provide one."""
    env = config.get("RDMAMW_TOKEN")
    if env:
        return env.encode()
    if _installed:
        return _installed
    path = _token_file()
    try:
        return _file_token(path)
    except OSError as e:
        raise ConfigError(
            f"no RDMAMW_TOKEN is set and the per-user token file {path} cannot be used "
            f"({e.strerror or e}): set RDMAMW_TOKEN to the same secret in every process "
            f"of the job, or make {os.path.dirname(path)} writable (or point "
            f"XDG_CONFIG_HOME at a writable directory)") from None


def _file_token(path: str) -> bytes:
    """The token in ``path``, created (mode 0600) on first use; OSError if it cannot
    be read or made."""
    for _ in range(100):
        try:
            with open(path, "rb") as f:
                data: bytes | None = f.read().strip()
        except FileNotFoundError:
            data = None
        if data:
            return data
        if data is None:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:     # another process won the race: use its token
                continue
            fresh = secrets.token_hex(32).encode()
            with os.fdopen(fd, "wb") as f:
                f.write(fresh)
            return fresh
        time.sleep(0.01)                # empty: its creator is about to write it
    raise OSError(errno.ENODATA, "the file is empty")


def job_key(job: str) -> bytes:
    """The key the channels of job ``job`` prove (the token bound to the job)."""
    return hmac.new(token(), b"rdmamw job " + job.encode(), hashlib.sha256).hexdigest().encode()


@contextmanager
def keyed(key: bytes | None) -> Iterator[None]:
    """``open_side`` calls in this thread prove ``key`` (None: the token) until exit."""
    old = getattr(_local, "key", None)
    _local.key = key
    try:
        yield
    finally:
        _local.key = old


def challenge() -> tuple[bytes, bytes]:
    """(the listener's nonce, the hello that carries it): the listener's first words."""
    nonce = secrets.token_bytes(NONCE)
    return nonce, MAGIC + bytes([VERSION]) + nonce


class _Answer:
    """A challenge a listener sent and the proof it read back, for ``accept_side``."""

    __slots__ = ("fd", "key", "nonce", "proof", "used")

    def __init__(self, fd: int, nonce: bytes, proof: bytes,
                 key: Callable[[], bytes] | None) -> None:
        self.fd, self.nonce, self.proof, self.key, self.used = fd, nonce, proof, key, False


@contextmanager
def answered(conn: socket.socket, nonce: bytes, proof: bytes,
             key: Callable[[], bytes] | None = None) -> Iterator[_Answer]:
    """In this thread, ``accept_side(conn)`` checks ``proof`` (already read) against the
    challenge ``nonce`` (already sent) with ``key()`` (None: the token). The caller
    checks ``used`` afterwards: a handshake that never checked the proof is refused."""
    a = _Answer(conn.fileno(), nonce, proof, key)
    old = getattr(_local, "answer", None)
    _local.answer = a
    try:
        yield a
    finally:
        _local.answer = old


def _mac(key: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    return recv_exact(conn, n, AuthError, "peer hung up during authentication")


def check_hello(data: bytes) -> bytes:
    """The listener's nonce from its hello, or AuthError."""
    if len(data) != HELLO_BYTES or data[:4] != MAGIC or data[4] != VERSION:
        raise AuthError("not an rdmamw peer (bad magic or version)")
    return data[5:]


def check_proof(data: bytes, key: bytes, nonce_l: bytes) -> bytes:
    """The opener's nonce if its proof is right, else AuthError."""
    nonce_o = check_hello(data[:HELLO_BYTES]) if len(data) == PROOF_BYTES else None
    if nonce_o is None or not hmac.compare_digest(data[HELLO_BYTES:],
                                                  _mac(key, b"open", nonce_l, nonce_o)):
        raise AuthError("peer failed to prove the shared token")
    return nonce_o


def accept_side(conn: socket.socket, key: bytes | None = None, *,
                tell: bool = False) -> None:
    """Listener half: challenge, check the opener's proof, prove ourselves. Under a
    listener's :func:`answered`, the challenge was sent and the proof read already.
    ``tell``: a wrong proof is answered with :data:`REFUSED` (else a plain hang-up)."""
    a = getattr(_local, "answer", None)
    if a is not None and not a.used and a.fd == conn.fileno():
        a.used = True
        nonce_l, proof = a.nonce, a.proof
        if key is None:
            key = a.key() if a.key is not None else token()
    else:
        key = token() if key is None else key
        nonce_l, hello = challenge()
        conn.sendall(hello)
        proof = _recv_exact(conn, PROOF_BYTES)
    try:
        nonce_o = check_proof(proof, key, nonce_l)
    except AuthError:
        if tell:
            try:
                conn.sendall(REFUSED)   # tell the opener it was the token, then hang up
            except OSError:
                pass
        raise
    conn.sendall(_mac(key, b"accept", nonce_o, nonce_l))


def open_side(conn: socket.socket, key: bytes | None = None) -> None:
    """Opener half: answer the challenge, then check the listener knows the token too.
    The key is ``key``, else the one :func:`keyed` set, else the token."""
    if key is None:
        key = getattr(_local, "key", None) or token()
    nonce_l = check_hello(_recv_exact(conn, HELLO_BYTES))
    nonce_o = secrets.token_bytes(NONCE)
    conn.sendall(MAGIC + bytes([VERSION]) + nonce_o + _mac(key, b"open", nonce_l, nonce_o))
    answer = _recv_exact(conn, MAC)
    if answer == REFUSED:
        raise TokenRefused("the listener refused our proof: it holds another shared token "
                        "(RDMAMW_TOKEN, or the per-user token file, differs) or belongs "
                        "to another job")
    if not hmac.compare_digest(answer, _mac(key, b"accept", nonce_o, nonce_l)):
        raise AuthError("listener failed to prove the shared token")
