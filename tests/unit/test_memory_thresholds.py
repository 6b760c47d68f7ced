"""Rendezvous thresholds (rdmamw/memory/thresholds.py): file, env, defaults, save."""

from __future__ import annotations

import json

import pytest

import rdmamw.providers as registry
from rdmamw.channel.rendezvous import tuned
from rdmamw.config import parse_bytes
from rdmamw.errors import ConfigError
from rdmamw.memory import thresholds as th
from rdmamw.memory.units import human


@pytest.fixture(autouse=True)
def tune_file(tmp_path, monkeypatch):
    path = tmp_path / "cfg" / "rendezvous.json"
    monkeypatch.setenv(th.FILE_ENV, str(path))
    monkeypatch.delenv(th.STRATEGY_ENV, raising=False)
    monkeypatch.delenv(th.THRESHOLD_ENV, raising=False)
    return path


def test_untuned_gives_the_built_in_defaults():
    for provider in ("shm", "tcp", "verbs"):
        default = registry.provider(provider).rendezvous_default
        got = th.lookup(provider, default=default)
        assert got["source"] == "built-in defaults"
        assert {k: got[k] for k in ("strategy", "threshold")} == default
        assert tuned(provider) == default          # what a channel's "auto" takes
    assert registry.provider("tcp").rendezvous_default["strategy"] == "write"
    assert th.lookup("future")["strategy"] == th.FALLBACK["strategy"]


def test_save_then_lookup_round_trips_and_keeps_other_providers(tune_file):
    th.save("shm", "read", 131072, measured={"sizes": [1, 2]})
    path = th.save("tcp", "write", "1M")
    assert path == tune_file
    cfg = json.loads(tune_file.read_text())
    assert set(cfg["providers"]) == {"shm", "tcp"}
    assert cfg["providers"]["shm"]["measured"] == {"sizes": [1, 2]}
    assert th.lookup("shm") == {"strategy": "read", "threshold": 131072,
                                "source": str(tune_file)}
    assert th.lookup("tcp")["threshold"] == 1 << 20
    assert th.lookup("verbs")["source"] == "built-in defaults"


def test_env_overrides_each_field(monkeypatch, tune_file):
    th.save("shm", "read", 131072)
    monkeypatch.setenv(th.STRATEGY_ENV, "WRITE")
    got = th.lookup("shm")
    assert (got["strategy"], got["threshold"]) == ("write", 131072)
    assert th.STRATEGY_ENV in got["source"]
    monkeypatch.setenv(th.THRESHOLD_ENV, "4M")
    assert th.lookup("shm")["threshold"] == 4 << 20


def test_an_explicit_path_wins_over_the_env_file(tmp_path):
    other = tmp_path / "other.json"
    th.save("shm", "write", 999, path=other)
    assert th.lookup("shm", other)["strategy"] == "write"
    assert th.lookup("shm")["source"] == "built-in defaults"


@pytest.mark.parametrize("content, match", [
    ("{not json", "cannot read"),
    ('["a"]', "expected"),
    ('{"providers": {"shm": {"strategy": "fast", "threshold": 1}}}', "strategy"),
    ('{"providers": {"shm": {"strategy": "read", "threshold": "big"}}}', "threshold"),
    ('{"providers": {"shm": {"strategy": "read"}}}', "threshold"),
    ('{"providers": {"shm": 3}}', "object"),
])
def test_malformed_file_is_a_config_error_naming_the_file(tune_file, content, match):
    tune_file.parent.mkdir(parents=True)
    tune_file.write_text(content)
    with pytest.raises(ConfigError, match=match) as e:
        th.lookup("shm")
    assert str(tune_file) in str(e.value)


def test_bad_env_and_bad_save_arguments(monkeypatch):
    monkeypatch.setenv(th.STRATEGY_ENV, "sometimes")
    with pytest.raises(ConfigError, match=th.STRATEGY_ENV):
        th.lookup("shm")
    monkeypatch.delenv(th.STRATEGY_ENV)
    monkeypatch.setenv(th.THRESHOLD_ENV, "-5")
    with pytest.raises(ConfigError, match=th.THRESHOLD_ENV):
        th.lookup("shm")
    with pytest.raises(ConfigError):
        th.save("shm", "eager", 1)


def test_byte_sizes():
    assert [parse_bytes(s) for s in ("4096", "64K", "64KiB", "1g", "1.5M", 7)] == \
        [4096, 65536, 65536, 1 << 30, 3 << 19, 7]
    for bad in ("", "K", "12X", "lots", True):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
    assert human(4 << 20) == "4 MiB" and human(512) == "512 B"
