"""Shared-token authentication of every tcp connection (channels and the bootstrap
store): a mutual HMAC-SHA256 challenge-response, so the token never crosses the
wire and a replayed transcript is useless (both sides contribute a fresh nonce).

The token is ``RDMAMW_TOKEN`` if set, else the one ``rdmamw.init()`` installed, else
a per-user secret in ``~/.config/rdmamw/token`` (mode 0600, created on first use),
which is enough for processes of one user on one host or a shared home."""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import socket
import time

from rdmamw import config
from rdmamw.errors import ConfigError, ProtocolError
from rdmamw.transport.wire import recv_exact

MAGIC = b"RDMW"
VERSION = 1
NONCE = 16
MAC = 32
HELLO_BYTES = len(MAGIC) + 1 + NONCE          # listener -> opener
PROOF_BYTES = HELLO_BYTES + MAC               # opener -> listener

_installed: bytes | None = None


class AuthError(ProtocolError):
    """The peer does not know the shared token (or spoke garbage)."""


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


def accept_side(conn: socket.socket, key: bytes | None = None) -> None:
    """Listener half: challenge, check the opener's proof, prove ourselves."""
    key = token() if key is None else key
    nonce_l = secrets.token_bytes(NONCE)
    conn.sendall(MAGIC + bytes([VERSION]) + nonce_l)
    nonce_o = check_proof(_recv_exact(conn, PROOF_BYTES), key, nonce_l)
    conn.sendall(_mac(key, b"accept", nonce_o, nonce_l))


def open_side(conn: socket.socket, key: bytes | None = None) -> None:
    """Opener half: answer the challenge, then check the listener knows the token too."""
    key = token() if key is None else key
    nonce_l = check_hello(_recv_exact(conn, HELLO_BYTES))
    nonce_o = secrets.token_bytes(NONCE)
    conn.sendall(MAGIC + bytes([VERSION]) + nonce_o + _mac(key, b"open", nonce_l, nonce_o))
    if not hmac.compare_digest(_recv_exact(conn, MAC), _mac(key, b"accept", nonce_o, nonce_l)):
        raise AuthError("listener failed to prove the shared token")
