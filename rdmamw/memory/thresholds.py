"""When a message goes by rendezvous, and which kind: per provider, measured.

``Channel.open(..., rendezvous="auto")`` asks :func:`lookup` for the provider's
``{"strategy": "read" | "write" | "off", "threshold": bytes}``: messages larger than
``threshold`` (and every message larger than the peer's eager slot) use rendezvous
with ``strategy``; smaller ones are copied through the eager ring. ``"off"`` keeps
everything eager (messages above the slot size then raise ``MessageTooLarge``).

Where the answer comes from, first match wins:

1. ``RDMAMW_RNDV_STRATEGY`` / ``RDMAMW_RNDV_THRESHOLD`` (each overrides its field);
2. the tuning file written by ``rdmamw tune rndv``: ``$RDMAMW_TUNE_FILE`` or
   ``~/.config/rdmamw/rendezvous.json``, a small JSON users may read and edit::

       {"version": 1,
        "providers": {"shm": {"strategy": "read", "threshold": 65536, ...}}}

3. built-in defaults (each provider's ``rendezvous_default``), used while nothing was tuned.

Arguments to ``Channel.open`` (``rendezvous="read"``, ``rndv_threshold=...``) override
all of these."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

from rdmamw import config
from rdmamw.config import parse_bytes
from rdmamw.errors import ConfigError
from rdmamw.vocabulary import READ, RNDV_STRATEGIES, check_rendezvous

FILE_ENV = "RDMAMW_TUNE_FILE"
STRATEGY_ENV = "RDMAMW_RNDV_STRATEGY"
THRESHOLD_ENV = "RDMAMW_RNDV_THRESHOLD"

#: untuned, for a provider that declares no default of its own (each provider declares
#: its ``rendezvous_default``, rdmamw/providers/base.py; the channel passes it in)
FALLBACK: dict[str, Any] = {"strategy": READ, "threshold": 64 << 10}


def default_path() -> Path:
    """``$RDMAMW_TUNE_FILE`` or ``~/.config/rdmamw/rendezvous.json``."""
    return Path(config.get(FILE_ENV) or
                Path.home() / ".config" / "rdmamw" / "rendezvous.json")


def check_strategy(value: Any, what: str = "strategy") -> str:
    """``value`` if the engine runs it (``rdmamw.vocabulary.RNDV_STRATEGIES``), else
    ConfigError naming ``what``."""
    return check_rendezvous(value, ConfigError, what, RNDV_STRATEGIES)


def _read(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: cannot read the rendezvous tuning file ({e}); fix "
                          f"or delete it, or point {FILE_ENV} elsewhere") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("providers", {}), dict):
        raise ConfigError(f"{path}: expected {{\"providers\": {{name: {{...}}}}}}")
    return cfg


def lookup(provider: str, path: str | os.PathLike | None = None,
           default: dict[str, Any] | None = None) -> dict[str, Any]:
    """``{"strategy", "threshold", "source"}`` for ``provider`` (a scheme); ``default``:
    the provider's own untuned choice (else :data:`FALLBACK`); ``source`` says where
    each value came from (for ``stats()`` and bug reports). Raises
    :class:`ConfigError` for a malformed file or variable."""
    p = Path(path) if path else default_path()
    entry = _read(p).get("providers", {}).get(provider)
    if entry is not None:
        if not isinstance(entry, dict):
            raise ConfigError(f"{p}: providers.{provider} must be an object")
        out = {"strategy": check_strategy(entry.get("strategy"),
                                          f"{p}: providers.{provider}.strategy"),
               "threshold": parse_bytes(entry.get("threshold", -1),
                                        f"{p}: providers.{provider}.threshold"),
               "source": str(p)}
    else:
        out = {**(default or FALLBACK), "source": "built-in defaults"}
    env_s, env_t = config.get(STRATEGY_ENV), config.get(THRESHOLD_ENV)
    if env_s:
        out["strategy"] = env_s
        out["source"] += f" + {STRATEGY_ENV}"
    if env_t is not None:
        out["threshold"] = env_t
        out["source"] += f" + {THRESHOLD_ENV}"
    return out


def save(provider: str, strategy: str, threshold: int,
         measured: dict[str, Any] | None = None,
         path: str | os.PathLike | None = None) -> Path:
    """Store ``provider``'s choice (and the measurements behind it) in the tuning file,
    keeping the other providers' entries; returns the path written."""
    check_strategy(strategy)
    threshold = parse_bytes(threshold, "threshold")
    p = Path(path) if path else default_path()
    cfg = _read(p) or {"version": 1, "providers": {}}
    cfg.setdefault("providers", {})[provider] = {
        "strategy": strategy,
        "threshold": threshold,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "source": "rdmamw tune rndv",
        **({"measured": measured} if measured else {}),
    }
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=1) + "\n")
    tmp.replace(p)
    return p
