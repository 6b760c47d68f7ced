"""One vocabulary (rdmamw/vocabulary.py): the channel modes and the rendezvous
strategies are declared once and imported, each checked by one function; job start-up
is the *bootstrap*, "rendezvous" is only the large-message protocol."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import rdmamw
from rdmamw import config, vocabulary
from rdmamw.errors import ConfigError, ProtocolError
from rdmamw.transport import wire

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: enumeration -> its words; a literal sequence spelling two words of one of them
#: outside rdmamw/vocabulary.py is a second declaration
ENUMS = {"MODES": set(vocabulary.MODES), "RNDV_OPTIONS": set(vocabulary.RNDV_OPTIONS)}
_QUOTED_RUN = re.compile(r"[(\[{]\s*((?:[\"']\w+[\"']\s*,\s*)+[\"']\w+[\"'])")


def _spelled(words: list[str]) -> list[str]:
    return [name for name, enum in ENUMS.items() if len(set(words) & enum) >= 2]


def second_declarations(root: pathlib.Path = ROOT) -> list[str]:
    """``path:line: ENUM`` for each literal tuple / list / set in rdmamw/ that spells
    two or more words of one enumeration."""
    out = []
    for path in sorted((root / "rdmamw").rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxd") or path.name == "vocabulary.py":
            continue
        text, rel = path.read_text(), path.relative_to(root)
        if path.suffix == ".py":
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                    words = [e.value for e in node.elts
                             if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                    out += [f"{rel}:{node.lineno}: {n}" for n in _spelled(words)]
        else:
            for i, line in enumerate(text.splitlines(), 1):
                for run in _QUOTED_RUN.findall(line.split("#")[0]):
                    words = re.findall(r"[\"'](\w+)[\"']", run)
                    out += [f"{rel}:{i}: {n}" for n in _spelled(words)]
    return out


def test_each_enumeration_is_declared_once():
    assert second_declarations() == []


def test_a_planted_second_declaration_is_found(tmp_path):
    for rel in ("rdmamw/memory/thresholds.py", "rdmamw/engine/_engine.pyx"):
        dest = tmp_path / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text((ROOT / rel).read_text())
    th = tmp_path / "rdmamw/memory/thresholds.py"
    th.write_text(th.read_text() + '\nSTRATEGIES = ("read", "write", "off")\n')
    eng = tmp_path / "rdmamw/engine/_engine.pyx"
    eng.write_text(eng.read_text() + '\n        if mode not in ("batched", "ack"):\n')
    found = second_declarations(tmp_path)
    assert [f.rsplit(": ", 1)[1] for f in found] == ["MODES", "RNDV_OPTIONS"], found


def test_the_settings_table_takes_its_choices_from_the_vocabulary():
    assert set(config.setting("RDMAMW_RNDV_STRATEGY").choices) == \
        {*vocabulary.RNDV_STRATEGIES, ""}
    assert set(config.setting("RDMAMW_ALLREDUCE_ALGORITHM").choices) == \
        {vocabulary.AUTO, *vocabulary.ALLREDUCE_ALGORITHMS, ""}


def test_a_bad_mode_is_refused_by_the_one_check_everywhere():
    with pytest.raises(ValueError, match="mode must be one of batched, ack, not 'fast'"):
        rdmamw.Channel.open("shm://nobody-there", mode="fast", timeout=0.1)
    hello = {"v": wire.PROTOCOL_VERSION, "slots": 8, "slot_size": 4096, "mode": "fast"}
    with pytest.raises(ProtocolError, match="the mode a peer asks for must be one of"):
        wire.check_hello(hello, wire.PROTOCOL_VERSION, None)
    hello["mode"] = vocabulary.ACK
    assert wire.check_hello(hello, wire.PROTOCOL_VERSION, None)[2] == "ack"


def test_a_bad_strategy_is_refused_by_the_one_check_everywhere(monkeypatch, tmp_path):
    from rdmamw.memory import thresholds
    with pytest.raises(ValueError, match="rendezvous must be one of auto, read, write, off"):
        rdmamw.Channel.open("shm://nobody-there", rendezvous="sideways", timeout=0.1)
    with pytest.raises(ConfigError, match="strategy must be one of read, write, off"):
        thresholds.save("shm", "auto", 1024, path=tmp_path / "t.json")
    monkeypatch.setenv("RDMAMW_RNDV_STRATEGY", "auto")
    with pytest.raises(ConfigError, match="RDMAMW_RNDV_STRATEGY"):
        config.get("RDMAMW_RNDV_STRATEGY")


def test_job_start_up_is_the_bootstrap_not_a_rendezvous():
    """No module of the bootstrap, and no setting of the bootstrap or the launchers,
    says "rendezvous"."""
    said = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "rdmamw/bootstrap").glob("*.py"))
            if "rendezvous" in p.read_text().lower()]
    assert set(said) <= PENDING, said
    assert [s.name for s in config.declared().values()
            if s.component in ("bootstrap", "launcher") and "rendezvous" in s.doc] == []


#: none left
PENDING: set[str] = set()
