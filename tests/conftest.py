"""Fixtures (the helpers the test modules import are in tests/support/helpers.py), the suite's
own settings (tests/support/isolation.py) and, inside the soft-RoCE VM, the rule that the
device half really ran."""

from __future__ import annotations

import os
import shutil

from tests.support.isolation import isolate

SUITE_HOME = isolate()      # before rdmamw is imported: no user config, no RDMAMW_* tuning

import pytest  # noqa: E402

from tests.support.helpers import (  # noqa: E402
    CMA_PATHS,
    VERBS_OK,
    VERBS_WHY,
    make_pair,
    provider_param,
    providers_under_test,
)

#: fixtures kept beside the helpers they use (one conftest module only:
#: tests/unit/test_suite_hygiene.py)
pytest_plugins = ["tests.support.region_fixtures"]


def pytest_unconfigure(config) -> None:
    shutil.rmtree(SUITE_HOME, ignore_errors=True)      # nothing of the suite's stays


#: inside scripts/rxe-vm.sh: a device that does not work is a failure, not a skip
IN_VM = os.environ.get("RXEVM_GUEST") == "1"


def pytest_sessionstart(session) -> None:
    if IN_VM and not VERBS_OK:
        pytest.exit(f"inside the soft-RoCE VM (RXEVM_GUEST=1) but the RDMA device is not "
                    f"usable: {VERBS_WHY}; the device tests would all skip", returncode=1)


_device_passed: list[str] = []


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.passed and "device" in report.keywords:
        _device_passed.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus) -> None:
    """In the VM, a run that selected device tests of which none passed did not test
    the device (they all skipped): fail it."""
    selected = any(i.get_closest_marker("device") for i in getattr(session, "items", ()))
    if IN_VM and exitstatus == 0 and selected and not _device_passed:
        session.exitstatus = 1
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("FAILED: inside the VM no device test passed", red=True)


@pytest.fixture(params=["batched", "ack"])
def mode(request):
    return request.param


def _parametrized_here(metafunc, name: str) -> bool:
    for m in metafunc.definition.iter_markers("parametrize"):
        names = m.args[0]
        if name in ([n.strip() for n in names.split(",")] if isinstance(names, str) else names):
            return True
    return False


def pytest_generate_tests(metafunc) -> None:
    """``provider`` runs on every provider under test; with ``cma`` too, on each
    provider's own copy paths (CMA_PATHS) only: no parameter that can only skip."""
    if "provider" not in metafunc.fixturenames or _parametrized_here(metafunc, "provider"):
        return
    names = providers_under_test()
    if "cma" in metafunc.fixturenames:
        metafunc.parametrize(("provider", "cma"),
                             [provider_param(p, c) for p in names
                              for c in CMA_PATHS.get(p, ("direct",))], indirect=True)
    else:
        metafunc.parametrize("provider", [provider_param(p) for p in names], indirect=True)


@pytest.fixture
def provider(request):
    return request.param


@pytest.fixture
def pair(mode, provider):
    a, b, lst = make_pair(mode, provider=provider)
    yield a, b
    a.close()
    b.close()
    lst.close()
