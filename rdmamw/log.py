"""The "rdmamw" logger, configured once on ``import rdmamw`` from two settings:

* ``RDMAMW_LOG_LEVEL``: ``debug``, ``info``, ``warning`` (the default), ``error`` or
  ``critical`` (or a number). At ``info``: the provider chosen for each peer and why,
  every connect and accept, refused peers, PeerLost with its cause, the settings and
  tuning files in use.
* ``RDMAMW_LOG_FILE``: write there instead of stderr; ``%h`` becomes the host name,
  ``%p`` the pid (``%%`` a percent sign), as NCCL_DEBUG_FILE: one file per process.

The root logger is never touched. When either variable is set, rdmamw adds its own
handler to the "rdmamw" logger; records still propagate, and the stderr handler stays
quiet while the application has handlers of its own (``logging.basicConfig`` or
handlers on "rdmamw"), so nothing is printed twice."""

from __future__ import annotations

import logging
import os
import socket

from rdmamw import _fork, config
from rdmamw.errors import ConfigError

LEVEL_ENV = "RDMAMW_LOG_LEVEL"
FILE_ENV = "RDMAMW_LOG_FILE"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}
FORMAT = "%(asctime)s %(hostname)s:%(process)d %(name)s %(levelname)s: %(message)s"

logger = logging.getLogger("rdmamw")
_handler: logging.Handler | None = None
_host = ""


def parse_level(text: str) -> int:
    """``"info"`` / ``"INFO"`` / ``"20"`` -> 20, or ConfigError naming the variable."""
    key = text.strip().lower()
    if key in LEVELS:
        return LEVELS[key]
    if key.isdigit():
        return int(key)
    raise ConfigError(f"{LEVEL_ENV}={text!r} is not a log level (one of "
                      f"{', '.join(n for n in LEVELS if n != 'warn')})")


def file_name(pattern: str) -> str:
    """``pattern`` with ``%h`` -> host name, ``%p`` -> pid, ``%%`` -> ``%``."""
    subs = {"h": socket.gethostname(), "p": str(os.getpid()), "%": "%"}
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "%" and i + 1 < len(pattern) and pattern[i + 1] in subs:
            out.append(subs[pattern[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


class _Quiet(logging.Filter):
    """Let a record through to stderr only while the application has no handlers of
    its own (they get the record by propagation)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers and all(
            h is _handler for h in logger.handlers)


class _Host(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.hostname = _host
        return True


def configure() -> None:
    """Apply RDMAMW_LOG_LEVEL / RDMAMW_LOG_FILE (once per process; again in a fork
    child, whose ``%p`` differs). Without them only the level is set, to warnings,
    and only if the application has not set one on "rdmamw" itself."""
    global _handler, _host
    level_text = config.get(LEVEL_ENV)
    pattern = config.get(FILE_ENV)
    level = parse_level(level_text) if level_text else None
    if level is not None:
        logger.setLevel(level)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)
    if not (level_text or pattern):
        return
    _host = socket.gethostname()
    if _handler is not None:
        logger.removeHandler(_handler)
        _handler.close()
    if pattern:
        path = file_name(pattern)
        try:
            _handler = logging.FileHandler(path, delay=False)
        except OSError as e:
            raise ConfigError(f"{FILE_ENV}={pattern!r}: cannot write {path} ({e.strerror})"
                              ) from None
    else:
        _handler = logging.StreamHandler()
        _handler.addFilter(_Quiet())
    _handler.addFilter(_Host())
    _handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(_handler)
    if not logger.isEnabledFor(logging.INFO):
        return      # the listing below imports every component (config.declared)
    settings = {r["name"]: r["value"] for r in config.effective()
                if r["source"] == "environment"}
    logger.info("rdmamw settings: %s", settings or "defaults")
    unknown = config.unknown()
    if unknown:
        logger.info("unknown RDMAMW_* variables (typos?): %s", ", ".join(unknown))


def _reopen_in_child() -> None:
    if _handler is not None and "%p" in config.get(FILE_ENV):
        configure()


_fork.at_child(_reopen_in_child)
