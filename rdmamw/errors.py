"""Typed errors. Every failure a user can meet is one of these, raised within a
bounded time; all derive from :class:`RdmamwError`."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

#: the kinds of failure counted (rdmamw.metrics: ``rdmamw_errors_total{kind}``)
KINDS = ("peer_lost", "timeout", "refused", "protocol")
#: errors of each kind this process made so far
COUNTS = dict.fromkeys(KINDS, 0)


class RdmamwError(Exception):
    """Base of every rdmamw error."""

    #: what :data:`COUNTS` counts it as (one of :data:`KINDS`), None: not counted
    error_kind: ClassVar[str | None] = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        kind = self.error_kind
        if kind is not None:
            # one failure, counted once: an error that re-raises one of its kind with
            # more said (the rank it was, the collective) is made while handling it
            handled = sys.exc_info()[1]
            if getattr(handled, "error_kind", None) != kind:
                COUNTS[kind] += 1


class PeerLost(RdmamwError, ConnectionError):
    """The peer process died or its connection broke without a clean close.

    Raised by a collective, ``rank`` is the member that was lost (as the members that
    saw it first reported it), whichever member this one was talking to."""

    error_kind = "peer_lost"

    rank: int | None = None


class PeerNotFound(RdmamwError, ConnectionError):
    """Nobody listens at the address (within the open timeout)."""

    error_kind = "refused"


class PeerRefused(RdmamwError, PermissionError):
    """The other side may not connect: a shm peer of another user (see
    ``RDMAMW_SHM_ALLOW_UIDS``), or a verbs listener whose pinned-memory budget
    (``RDMAMW_VERBS_PINNED_BYTES``) has no room for the channel. The message names the
    peer and what to change."""

    error_kind = "refused"


class ChannelClosed(RdmamwError):
    """The channel was closed, by this side or cleanly by the peer."""


class MessageLost(RdmamwError):
    """One message could not be received: its sender closed (or was closed) before the
    message's data was read. Raised once, for that message; the channel goes on with
    the messages that follow it, then says ChannelClosed."""


class InheritedChannel(ChannelClosed):
    """A channel or listener used in a child process after ``fork``: it belongs to the
    parent, which still uses it. The child must open its own channels."""


class Timeout(RdmamwError, TimeoutError):
    """A blocking call reached its timeout.

    For ``send_batch``, ``sent`` tells how many of the batch's messages were sent
    before the timeout (they will be delivered; the rest were not sent). Raised by a
    collective, ``rank`` is the member that made no progress."""

    error_kind = "timeout"

    rank: int | None = None     # a collective's: the member that made no progress

    def __init__(self, message: str, sent: int = 0) -> None:
        super().__init__(message)
        self.sent = sent


class Excluded(RdmamwError):
    """A shrink (``comm.shrink()``) agreed on survivors without this rank: other
    members counted it as failed (it fell behind, or could not be reached). Raised on
    that rank at once, instead of a wait for its deadline."""


class MessageTooLarge(RdmamwError, ValueError):
    """A message is larger than the peer's eager slot; nothing of the batch was sent."""


class BufferTooSmall(RdmamwError, ValueError):
    """``recv_into`` (or a posted buffer) is smaller than the next message; ``needed``
    is its size. The message was not consumed: receive it again with a bigger buffer."""

    def __init__(self, message: str, needed: int = 0) -> None:
        super().__init__(message)
        self.needed = needed


class ProtocolError(RdmamwError):
    """The peer wrote something that breaks the wire protocol (bad header, bad
    sequence number, bad descriptor). The channel is unusable afterwards."""

    error_kind = "protocol"


class ProviderUnavailable(RdmamwError):
    """The requested transport cannot run here (for example no RDMA device)."""


class RemoteAccessError(RdmamwError):
    """A one-sided operation on a peer's exposed region (docs/remote-memory.md) was
    refused: nothing of it was read or written on the owner's side, and the channel
    stays usable. The subclasses say why; this class itself is a reference that is not
    one (bad length, magic, version or check word)."""


class ForeignReference(RemoteAccessError):
    """The reference names a region of another channel (or another job, or an earlier
    connection): only the peer at the other end of this channel made it valid here."""


class RegionRevoked(RemoteAccessError):
    """The peer does not expose a region under this reference (any more): it revoked
    it, closed, or never exposed it (a forged reference). Raised during a read, the
    destination is incomplete."""


class AccessDenied(RemoteAccessError, PermissionError):
    """The region does not allow this access (a write to a read-only region, an atomic
    on a region not exposed for atomics, an unaligned atomic)."""


class OutOfRange(RemoteAccessError, IndexError):
    """The operation reaches outside the exposed region."""


class ConfigError(RdmamwError, ValueError):
    """A setting (argument, environment variable or tuning file) has a value that
    cannot be used; the message names the setting and what is accepted."""


class WrongLoop(RdmamwError, RuntimeError):
    """An rdmamw.aio channel or listener awaited from another event loop than the one
    that first used it (its descriptor is watched by that loop). Open a channel per
    loop, or use the blocking API from other threads."""


class RegistrationError(RdmamwError, BufferError):
    """A buffer cannot be registered (not contiguous, zero-length, ...) or a pooled
    buffer or registration lease was released twice."""


@contextmanager
def setup_errors(what: str) -> Iterator[None]:
    """Socket and system errors of connection set-up reach the user as rdmamw errors
    that say what to do: a connection the peer broke (reset, hung up) is PeerLost, any
    other OSError (no permission, out of descriptors or memory) ProviderUnavailable."""
    try:
        yield
    except RdmamwError:
        raise
    except TimeoutError as e:
        raise Timeout(f"{what}: the peer did not finish the set-up in time ({e}); "
                      f"retry") from e
    except ConnectionError as e:
        raise PeerLost(f"{what}: the peer broke the connection during set-up ({e}); "
                       f"check that it runs the same rdmamw version and retry") from e
    except OSError as e:
        raise ProviderUnavailable(f"{what}: {e} (check permissions and the limits on "
                                  f"open files and locked memory: ulimit -n / -l)") from e


__all__ = [
    "BufferTooSmall",
    "ChannelClosed",
    "ConfigError",
    "InheritedChannel",
    "MessageLost",
    "MessageTooLarge",
    "PeerLost",
    "PeerNotFound",
    "PeerRefused",
    "ProtocolError",
    "ProviderUnavailable",
    "RdmamwError",
    "RegistrationError",
    "Timeout",
    "WrongLoop",
    "setup_errors",
]
