"""The suite runs with its own settings: a user's ``~/.config/rdmamw`` files and
``RDMAMW_*`` variables must not change what a test sees (a tuned ``write`` threshold
of 1 KiB once failed four ordering tests). Applied by conftest before rdmamw is
imported; child processes inherit the cleaned environment."""

from __future__ import annotations

import os
import tempfile

#: set by the test harness itself (which providers, how far time bounds stretch, a
#: plug-in provider to run the suite on, the VM, the device the machine has)
KEEP = frozenset({"RDMAMW_TEST_PROVIDERS", "RDMAMW_TEST_SLOWER", "RDMAMW_PROVIDER_PLUGINS",
                  "RDMAMW_VM", "RDMAMW_VERBS_DEVICE", "RDMAMW_VERBS_PORT",
                  "RDMAMW_VERBS_GID_INDEX"})


def isolate(environ=os.environ) -> str:
    """Drop every other ``RDMAMW_*`` variable and point HOME and XDG_CONFIG_HOME at a
    fresh directory (no tuning files, a token file of the suite's own); returns it."""
    for name in [n for n in environ if n.startswith("RDMAMW_") and n not in KEEP]:
        del environ[name]
    home = tempfile.mkdtemp(prefix="rdmamw-test-home-")
    environ["HOME"] = home
    environ["XDG_CONFIG_HOME"] = os.path.join(home, ".config")
    return home
