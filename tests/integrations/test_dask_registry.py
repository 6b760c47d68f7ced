"""The ``rdmamw://`` comm asks the provider registry and names no provider
(rdmamw/dask/comm.py, offer.py; docs/architecture.md, "Where a newcomer adds a
provider"): no ``rdmamw.providers.<name>`` import and no scheme spelled under
rdmamw/dask but the documented default of ``distributed.comm.rdmamw.base``; the plug-in
provider of the tests (tests/support/uds_provider.py, loaded by
``RDMAMW_PROVIDER_PLUGINS``) carries a comm with no change there; the cancellation-safe
open is ``rdmamw.aio.open_channel``."""

from __future__ import annotations

import ast
import asyncio
import pathlib
import sys
import threading
import time

import pytest

distributed = pytest.importorskip("distributed", reason="dask distributed is not installed "
                                  "(pip install rdmamw[dask])")
import dask  # noqa: E402
from distributed.comm import connect, listen  # noqa: E402

import rdmamw  # noqa: E402
import rdmamw.dask  # noqa: E402
import rdmamw.providers as registry  # noqa: E402
from rdmamw import aio  # noqa: E402
from tests.support.dask_echo import echo  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASK = ROOT / "rdmamw" / "dask"


def _default_of_config_get(node: ast.AST, parents: dict) -> bool:
    """Whether ``node`` is the ``default=`` of a ``dask.config.get(...)`` call (a
    documented default, docs/dask.md)."""
    kw = parents.get(node)
    call = parents.get(kw)
    return (isinstance(kw, ast.keyword) and kw.arg == "default"
            and isinstance(call, ast.Call) and ast.unparse(call.func) == "dask.config.get")


def provider_names(root: pathlib.Path = DASK) -> list[str]:
    """``file:line: what`` for each import of a provider's package and each string that
    spells a built-in scheme (``"tcp"``, ``"verbs://..."``) in the Python of ``root``."""
    schemes = list(registry.BUILTIN)
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        rel = path.relative_to(root.parent.parent)
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for m in mods:
                parts = m.split(".")
                if parts[:2] == ["rdmamw", "providers"] and len(parts) > 2 and \
                        parts[2] in schemes:
                    out.append(f"{rel}:{node.lineno}: imports {m}")
                    break
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                s = node.value
                named = [k for k in schemes if s == k or f"{k}://" in s]
                if named and not _default_of_config_get(node, parents) and \
                        not isinstance(parents.get(parents.get(node)), (ast.Module,
                                                                       ast.FunctionDef,
                                                                       ast.ClassDef,
                                                                       ast.AsyncFunctionDef)):
                    out.append(f"{rel}:{node.lineno}: spells {named[0]} in {s[:40]!r}")
    return out


def test_the_dask_comm_names_no_provider():
    assert provider_names() == []


def test_a_planted_provider_name_is_found(tmp_path):
    pkg = tmp_path / "rdmamw" / "dask"
    pkg.mkdir(parents=True)
    for f in DASK.glob("*.py"):
        (pkg / f.name).write_text(f.read_text())
    assert provider_names(pkg) == []
    comm = pkg / "comm.py"
    comm.write_text(comm.read_text() + '\n\ndef _planted(ch):\n'
                    '    return ch.sync.provider == "shm"\n')
    (pkg / "offer.py").write_text((pkg / "offer.py").read_text() +
                                  "\nfrom rdmamw.providers.verbs import rank\n")
    got = provider_names(pkg)
    assert len(got) == 2, got
    assert got[0].startswith("rdmamw/dask/comm.py:") and "spells shm" in got[0]
    assert got[1].startswith("rdmamw/dask/offer.py:") and \
        "imports rdmamw.providers.verbs" in got[1]


@pytest.fixture
def uds_plugin(monkeypatch):
    """tests/support/uds_provider.py loaded as a job loads it: RDMAMW_PROVIDER_PLUGINS."""
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "support"))
    monkeypatch.setenv("RDMAMW_PROVIDER_PLUGINS", "uds_provider")
    monkeypatch.setattr(registry, "_plugins_loaded", None)
    try:
        assert "uds" in registry.schemes()
        yield registry.provider("uds")
    finally:
        registry.unregister("uds")
        registry._plugins_loaded = None


def test_a_plugin_provider_carries_rdmamw_comms_with_no_change_in_rdmamw_dask(uds_plugin):
    """uds:// (host-local, preference 400 > shm's 300) is listened on and taken by a
    connector to its own host, as shm is without it; with the host-local providers
    switched off the comm runs on the base provider."""
    assert not uds_plugin.network and uds_plugin.preference > \
        registry.provider("shm").preference
    rdmamw.dask.register()

    async def main(want: str, same_host: bool):
        async with listen("rdmamw://127.0.0.1:0", echo) as lst:
            for i in range(3):
                comm = await connect(lst.contact_address)
                assert comm.extra_info["provider"] == want
                assert comm.same_host is same_host
                await comm.write({"i": i, "b": b"x" * 100_000})
                assert await comm.read() == {"i": i, "b": b"x" * 100_000}
                await comm.close()

    asyncio.run(asyncio.wait_for(main("uds", True), 60))
    with dask.config.set({"distributed.comm.rdmamw.shm": False}):
        asyncio.run(asyncio.wait_for(main("tcp", False), 60))


def test_open_channel_closes_a_channel_that_arrives_after_cancellation(monkeypatch):
    """The open runs in an executor thread, which cannot be stopped: a channel it gets
    after the caller was cancelled is closed, not leaked."""
    from rdmamw import channel as sync
    gate, opened = threading.Event(), []
    real = sync.Channel.open

    def slow_open(address, **opts):
        gate.wait(10)
        ch = real(address, **opts)
        opened.append(ch)
        return ch

    monkeypatch.setattr(sync.Channel, "open", staticmethod(slow_open))
    lst = rdmamw.listen("tcp://127.0.0.1:0", slots=4)
    try:
        async def main():
            task = asyncio.ensure_future(aio.open_channel(lst.address, 5.0, slots=4))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.set()
            server = await asyncio.get_running_loop().run_in_executor(None, lst.accept, 5.0)
            deadline = time.monotonic() + 5
            while not (opened and opened[0].closed) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            server.close()

        asyncio.run(asyncio.wait_for(main(), 30))
        assert opened and opened[0].closed, "the late channel was leaked"
    finally:
        lst.close()


def test_open_channel_is_what_the_dask_comm_opens_with():
    import inspect

    from rdmamw.dask import comm
    assert "await open_channel(" in inspect.getsource(comm._open)
    assert comm.open_channel is aio.open_channel
    assert not hasattr(comm, "_close_late") and "run_in_executor" not in \
        inspect.getsource(comm._open)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
