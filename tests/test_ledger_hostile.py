"""A ledger damaged, planted or raced while engines run: nothing in it stops an engine or
`kvmem top` / `kvmem limit`, no damage lets engines pass the device total, and a file of
another user or process never takes a user's ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvmem.cli import main
from kvmem.errors import ConfigError
from kvmem.memory import ledger as ledger_module
from kvmem.memory.ledger import Ledger, LedgerError, parse_table, process_start_time

MiB = 1 << 20
DEEP = [b"[" * 100_000, b'{"engines": {"A": ' + b'{"x": ' * 50_000 + b"1" + b"}" * 50_002]


@pytest.mark.parametrize("content", DEEP, ids=["list", "entry"])
def test_a_ledger_nested_too_deep_is_damage_not_an_exception(tmp_path, content, capsys):
    """Nesting deeper than the recursion limit raised RecursionError out of the reader:
    a running engine died at its next look, `kvmem top` and `kvmem limit` ended in a
    traceback."""
    assert parse_table(content, "cpu").damage == ["nested too deep to read"]
    path = tmp_path / "kvmem-ledger-cpu.json"
    budget = Ledger.for_device("cpu", tmp_path).register("a", total_limit=4 * MiB)
    assert budget.try_acquire(MiB)
    path.write_bytes(content)
    assert main(["top", "--json", "--ledger-dir", str(tmp_path)]) == 0
    [device] = json.loads(capsys.readouterr().out)["devices"]
    assert device["damage"] == ["nested too deep to read"]
    assert main(["top", "--ledger-dir", str(tmp_path)]) == 0
    assert "is damaged" in capsys.readouterr().out
    assert main(["limit", "nobody", "1GiB", "--ledger-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    budget.peek()  # the idle engine's poll puts its entry and the total back
    table = Ledger.for_device("cpu", tmp_path).read()
    assert (table.total_limit, table.damage) == (4 * MiB, [])
    assert table.engines["a"].mapped_bytes == MiB
    assert budget.try_acquire(MiB)


def test_damage_messages_stay_short_whatever_the_value(tmp_path):
    deep = "[" * 900 + "]" * 900
    raw = json.dumps({"total_limit": "@", "engines": {"a": {"pid": 1, "floor_bytes":
                                                            "x" * 100_000}}})
    raw = raw.replace('"@"', deep).encode()
    damage = parse_table(raw, "cpu").damage
    assert len(damage) == 2 and all(len(d) < 200 for d in damage)


def _two_engines(tmp_path):
    """A idle with 20 MiB of a 40 MiB total, B beside it with nothing."""
    path = tmp_path / "kvmem-ledger-cpu.json"
    a = Ledger.for_device("cpu", tmp_path).register("A", total_limit=40 * MiB)
    b = Ledger.for_device("cpu", tmp_path).register("B")
    assert a.try_acquire(20 * MiB)
    return path, a, b


def _without_a(path):
    doc = json.loads(path.read_bytes())
    del doc["engines"]["A"]
    return json.dumps(doc).encode()


@pytest.mark.parametrize("damage", [
    lambda path: b"",
    lambda path: b"{}",
    lambda path: b'{"total_limit": 41943040, "engines": {"B": ' +
    json.dumps(json.loads(path.read_bytes())["engines"]["B"]).encode() + b"}}",
    lambda path: path.read_bytes()[:40],
    lambda path: b"garbage",
    lambda path: path.read_bytes().replace(b'"total_limit": 41943040', b'"total_limit": NaN'),
    lambda path: path.read_bytes().replace(b'"total_limit": 41943040', b'"total_limit": "40M"'),
    lambda path: path.read_bytes().replace(b'"mapped_bytes": 20971520', b'"mapped_bytes": "x"'),
    _without_a,
], ids=["empty", "{}", "no-A", "truncated", "garbage", "NaN", "str", "field", "no-A-json"])
def test_an_idle_engine_puts_its_entry_and_the_total_back_at_its_next_look(tmp_path, damage):
    """Damage dropped idle engine A (or the total): B then took the whole 40 MiB total
    while A still held 20 MiB, and the next write stored no total for good."""
    path, a, b = _two_engines(tmp_path)
    path.write_bytes(damage(path))
    a.peek()  # an idle engine only reads (its watch, every 50 ms)
    assert not b.try_acquire(21 * MiB)
    assert b.try_acquire(20 * MiB)
    table = Ledger.for_device("cpu", tmp_path).read()
    assert table.total_limit == 40 * MiB
    assert {n: e.mapped_bytes for n, e in table.engines.items()} == {"A": 20 * MiB,
                                                                    "B": 20 * MiB}


def test_a_write_of_a_damaged_ledger_keeps_its_total_unknown_not_none(tmp_path):
    """`kvmem limit` on a ledger whose total was lost must not store "no total": a busy
    engine, which writes at its next take, puts back the one it knows."""
    path, a, b = _two_engines(tmp_path)
    path.write_bytes(path.read_bytes().replace(b'"total_limit": 41943040',
                                               b'"total_limit": [1]'))
    Ledger.for_device("cpu", tmp_path).set_limits("A", floor_bytes=MiB)
    assert "total_limit" not in json.loads(path.read_bytes())
    assert not b.try_acquire(21 * MiB)  # B knows the total too
    assert Ledger.for_device("cpu", tmp_path).total_limit() == 40 * MiB


def test_a_total_removed_or_set_on_purpose_is_what_engines_keep(tmp_path):
    path, a, b = _two_engines(tmp_path)
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(None)
    a.peek(), b.peek()  # every engine looks within 50 ms
    path.write_bytes(b"{}")
    a.peek(), b.peek()
    assert ledger.total_limit() is None  # removed, not lost: nothing to put back
    ledger.set_total_limit(30 * MiB)
    a.peek(), b.peek()
    path.write_bytes(b"{}")
    b.peek()
    assert ledger.total_limit() == 30 * MiB


def _sleeper():
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_an_entry_whose_pid_was_reused_is_reaped(tmp_path):
    """A dead engine whose pid another process took kept its memory in the ledger until
    that process ended; its start time tells them apart (entries without one keep the
    pid-only check)."""
    proc = _sleeper()
    try:
        start = process_start_time(proc.pid)
        assert start is not None
        path = tmp_path / "kvmem-ledger-cpu.json"
        entries = {"reused": {"pid": proc.pid, "start_time": start - 1, "mapped_bytes": 6 * MiB},
                   "same": {"pid": proc.pid, "start_time": start, "mapped_bytes": MiB},
                   "old": {"pid": proc.pid, "mapped_bytes": MiB}}
        path.write_text(json.dumps({"total_limit": 16 * MiB, "engines": entries}))
        ledger = Ledger.for_device("cpu", tmp_path)
        assert sorted(e.name for e in ledger.entries()) == ["old", "same"]
        budget = ledger.register("new")
        assert budget.try_acquire(14 * MiB)  # the 6 MiB of "reused" are free
        assert ledger.read().engines["new"].start_time == process_start_time(os.getpid())
    finally:
        proc.kill()
        proc.wait()


def test_a_ledger_with_another_hard_link_is_refused(tmp_path, capsys):
    ledger = Ledger.for_device("cpu", tmp_path)
    budget = ledger.register("a", ceiling_bytes=1000)
    os.link(ledger.path, tmp_path / "copy")
    with pytest.raises(LedgerError, match="has 2 hard links; not touching it"):
        ledger.read()
    assert budget.try_acquire(100)  # the engine goes on with its own accounting
    assert (tmp_path / "copy").read_bytes() == ledger.path.read_bytes()  # nothing written
    assert main(["top", "--ledger-dir", str(tmp_path)]) == 0
    assert "hard links" in capsys.readouterr().out


def test_the_default_ledger_is_this_users_own(tmp_path, monkeypatch, capsys):
    """In the default folder (every user writes there) the name holds the uid: another
    user's file of the old name cannot stop this user's engines, and `kvmem top` and
    `kvmem limit` find the engines' file."""
    monkeypatch.delenv("KVMEM_LEDGER_DIR", raising=False)
    monkeypatch.setattr(ledger_module, "ledger_dir", lambda: tmp_path)
    planted = tmp_path / "kvmem-ledger-cpu.json"
    planted.write_text("{}")
    if os.geteuid() == 0:
        os.chown(planted, 65534, 65534)
    budget = Ledger.for_device("cpu").register("mine")
    assert budget.ledger.path == tmp_path / f"kvmem-{os.geteuid()}-ledger-cpu.json"
    assert main(["limit", "mine", "1GiB"]) == 0
    assert main(["top", "--json"]) == 0
    out = capsys.readouterr().out
    [device] = json.loads(out[out.index("{"):])["devices"]
    assert (device["device"], device["engines"][0]["ceiling_bytes"]) == ("cpu", 1 << 30)
    assert planted.read_text() == "{}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_ledger_of_another_user_names_the_way_round_it(tmp_path, monkeypatch):
    path = tmp_path / f"kvmem-{os.geteuid()}-ledger-cpu.json"
    path.write_text("{}")
    os.chown(path, 65534, 65534)
    monkeypatch.delenv("KVMEM_LEDGER_DIR", raising=False)
    monkeypatch.setattr(ledger_module, "ledger_dir", lambda: tmp_path)
    with pytest.raises(LedgerError, match="belongs to user 65534.*set KVMEM_LEDGER_DIR"):
        Ledger.for_device("cpu").register("a")


@pytest.mark.parametrize("name", [" ", "", "  \t", "a\x01", " a", "a "])
def test_blank_or_padded_engine_names_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="engine name .*printable characters, not starting"):
        Ledger.for_device("cpu", tmp_path).register(name)
    raw = json.dumps({"engines": {name: {"pid": os.getpid()}}}).encode()
    table = parse_table(raw, "cpu")
    assert table.engines == {} and table.damage


@pytest.mark.parametrize("name", [" ", "a\x01"])
def test_kvmem_limit_refuses_a_blank_engine_name_in_one_line(tmp_path, capsys, name):
    assert main(["limit", name, "1GiB", "--ledger-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "printable characters, not starting" in err


def test_a_blank_engine_name_flag_is_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVMEM_LEDGER_DIR", str(tmp_path))
    assert main(["generate", "--kv-memory", "elastic", "--engine-name", " ", "--max-tokens",
                 "1", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "engine name ' '" in err


def test_the_fallback_log_line_says_no_limit_when_there_is_none(tmp_path, caplog):
    budget = Ledger.for_device("cpu", tmp_path).register("a")
    budget.ledger.path.unlink()
    budget.ledger.path.mkdir()
    with caplog.at_level("WARNING", logger="kvmem.memory"):
        assert budget.try_acquire(100)
    [line] = [r.getMessage() for r in caplog.records if "own accounting" in r.getMessage()]
    assert line.endswith("(no limit)") and "None" not in line
