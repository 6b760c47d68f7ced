"""The channel example of README.md runs as written: its ``serve`` in one process, its
``client`` in another, on shm; the server sums the array the client sent."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_channel_example() -> str:
    """The first python block after the heading "## A channel" of README.md."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## A channel\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_channel_example_runs(tmp_path):
    module = tmp_path / "readme_channel.py"
    module.write_text(readme_channel_example())
    address = f"shm://readme-{uuid.uuid4().hex[:12]}"
    run = textwrap.dedent(f"""
        import sys, threading
        sys.path.insert(0, {str(tmp_path)!r})
        import readme_channel
        server = threading.Thread(target=readme_channel.serve, args=({address!r},))
        server.start()
        """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    server = subprocess.Popen([sys.executable, "-c", run + "server.join()\n"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import readme_channel
        readme_channel.client({address!r})
        """)], env=env, capture_output=True, text=True, timeout=60)
    out, err = server.communicate(timeout=60)
    assert client.returncode == 0, client.stderr[-3000:]
    assert server.returncode == 0, err[-3000:]
    assert client.stdout.split() == ["1"]
    assert out.split() == ["1000.0"]
