"""Floors, ceilings, the device total and asks to give back (``kvmem.memory.sharing``),
through real ledger files."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.cli import main
from kvmem.errors import ConfigError
from kvmem.memory.ledger import Ledger
from kvmem.memory.sharing import reserved

MiB = 1 << 20


def test_a_floor_is_reserved_whatever_the_others_do(tmp_path):
    ledger = Ledger(tmp_path / "l.json")
    ledger.set_total_limit(100 * MiB)
    a = ledger.register("a", floor_bytes=30 * MiB)
    b = ledger.register("b")
    assert not b.try_acquire(71 * MiB)  # would grow into a's floor
    assert b.try_acquire(70 * MiB)
    assert a.try_acquire(30 * MiB)  # a's floor was kept for it
    assert not a.try_acquire(1)


def test_floors_that_exceed_the_total_are_refused(tmp_path, capsys):
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(100 * MiB)
    ledger.register("a", floor_bytes=60 * MiB)
    with pytest.raises(ConfigError, match="floors would add up to 110.00 MiB, above the device"):
        ledger.register("b", floor_bytes=50 * MiB)
    b = ledger.register("b", floor_bytes=40 * MiB)
    assert b is not None
    assert main(["limit", "b", "--min", "41MiB", "--ledger-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmem: error: engine 'b': floors would add up to") and \
        err.count("\n") == 1
    assert main(["limit", "--total", "90MiB", "--device", "cpu", "--ledger-dir",
                 str(tmp_path)]) == 2
    assert "cannot hold the floors" in capsys.readouterr().err
    assert ledger.total_limit() == 100 * MiB  # nothing was written
    assert main(["limit", "b", "--min", "10MiB", "--max", "20MiB", "--ledger-dir",
                 str(tmp_path)]) == 0
    entry = ledger.read().engines["b"]
    assert (entry.floor_bytes, entry.ceiling_bytes) == (10 * MiB, 20 * MiB)
    assert main(["limit", "b", "--min", "30MiB", "--ledger-dir", str(tmp_path)]) == 2
    assert "above its ceiling" in capsys.readouterr().err


def test_a_ceiling_below_one_request_is_refused(tmp_path, capsys):
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.register("a", request_bytes=8 * MiB)
    assert main(["limit", "a", "4MiB", "--ledger-dir", str(tmp_path)]) == 2
    assert "below one request of its max_model_len (8.00 MiB)" in capsys.readouterr().err
    assert main(["limit", "a", "8MiB", "--ledger-dir", str(tmp_path)]) == 0


def test_reclaim_asks_the_least_recently_active_engine_for_what_it_only_caches(tmp_path):
    ledger = Ledger(tmp_path / "l.json")
    ledger.set_total_limit(100 * MiB)
    old = ledger.register("old", floor_bytes=10 * MiB)
    recent = ledger.register("recent")
    busy = ledger.register("busy")
    assert old.try_acquire(40 * MiB)
    assert recent.try_acquire(30 * MiB)
    assert busy.try_acquire(30 * MiB)
    old.report(5 * MiB, 30 * MiB)  # 5 live, 30 cached, 5 free
    recent.report(0, 30 * MiB)
    busy.report(30 * MiB)  # all live: never asked
    newcomer = ledger.register("new")
    assert not newcomer.try_acquire(35 * MiB)
    table = ledger.read()
    # old gives first (least recently active) what it holds above max(floor, live): 30
    assert table.engines["old"].reclaim_bytes == 30 * MiB
    assert table.engines["recent"].reclaim_bytes == 5 * MiB
    assert table.engines["busy"].reclaim_bytes == 0
    assert table.engines["new"].wanted_bytes == 35 * MiB
    assert not newcomer.try_acquire(35 * MiB)  # asked again: outstanding asks count
    assert ledger.read().engines["old"].reclaim_bytes == 30 * MiB
    assert old.peek().reclaim_bytes == 30 * MiB
    old.release(30 * MiB)
    old.gave_back(30 * MiB, old.peek())
    recent.release(5 * MiB)
    recent.gave_back(5 * MiB, recent.peek())
    assert newcomer.try_acquire(35 * MiB)
    table = ledger.read()
    assert table.engines["new"].wanted_bytes == 0
    assert (table.engines["old"].reclaimed_bytes, table.engines["old"].reclaims) == \
        (30 * MiB, 1)
    assert all(e.reclaim_bytes == 0 for e in table.engines.values())


def test_an_engine_limited_by_its_own_ceiling_asks_nobody(tmp_path):
    ledger = Ledger(tmp_path / "l.json")
    ledger.set_total_limit(100 * MiB)
    other = ledger.register("other")
    assert other.try_acquire(50 * MiB)
    small = ledger.register("small", ceiling_bytes=10 * MiB)
    assert not small.try_acquire(20 * MiB)
    assert ledger.read().engines["other"].reclaim_bytes == 0


def test_a_new_wait_for_memory_does_not_inherit_an_old_ones_time(monkeypatch):
    """A burst waited for memory until its requests ran; the next burst, a minute later,
    waits afresh (before: the 5 s counted from the first wait, so the engine preempted at
    once, with an idle engine's cache on the way)."""
    from kvmem.memory import budget

    now = [0.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: now[0])
    wait = budget.MemoryWait(wait_s=5)
    assert wait(True, 300)
    now[0] = 1.0
    assert wait(True, 400)  # it came; the burst ran and finished (no call said "not coming")
    now[0] = 61.0
    assert wait(True, 100)  # the next burst, holding less than the last one did
    now[0] = 65.9
    assert wait(True, 100)
    now[0] = 66.0
    assert not wait(True, 100)


def test_memory_given_back_since_an_engine_last_looked_counts_as_coming(tmp_path):
    """An engine that read the ledger at its step's start and is short of blocks asks for
    them: memory another engine gave back since is there already, so it is coming (the
    engine waits a step for it rather than preempting a request of its own)."""
    ledger = Ledger(tmp_path / "l.json")
    ledger.set_total_limit(100 * MiB)
    idle = ledger.register("idle")
    busy = ledger.register("busy")
    assert idle.try_acquire(60 * MiB) and busy.try_acquire(40 * MiB)
    idle.report(0, 60 * MiB)
    assert busy.want(20 * MiB)  # asked of the idle engine: coming
    idle.release(60 * MiB)
    idle.gave_back(60 * MiB, idle.peek())
    assert busy.want(20 * MiB)  # there already (before: False, and vLLM preempted)
    assert ledger.read().engines["busy"].wanted_bytes == 0
    # where no limit applies, no shortage is the ledger's: nothing comes
    ledger.set_total_limit(None)
    assert not busy.want(20 * MiB)


@settings(max_examples=60, deadline=None)
@given(floors=st.lists(st.integers(0, 30), min_size=2, max_size=4),
       ops=st.lists(st.tuples(st.integers(0, 3), st.integers(-20, 40)), max_size=40))
def test_takes_never_pass_the_total_and_floors_stay_reachable(tmp_path_factory, floors, ops):
    """Whatever the order of takes and gives: every engine counted at max(held, floor)
    fits the total, and each engine can always take up to its floor."""
    total = 100
    if sum(floors) > total:
        floors = [f * total // sum(floors) for f in floors]
    ledger = Ledger(tmp_path_factory.mktemp("l") / "l.json")
    ledger.set_total_limit(total)
    budgets = [ledger.register(f"e{i}", floor_bytes=f) for i, f in enumerate(floors)]
    for who, amount in ops:
        budget = budgets[who % len(budgets)]
        if amount >= 0:
            budget.try_acquire(amount)
        else:
            budget.release(min(-amount, budget.held_bytes))
        table = ledger.read()
        assert sum(reserved(e) for e in table.engines.values()) <= total
    for budget in budgets:
        if budget.held_bytes < budget.floor_bytes:
            assert budget.try_acquire(budget.floor_bytes - budget.held_bytes)


def test_what_an_engine_may_hold_is_read_at_every_take(tmp_path):
    """Its cap follows every write, not only its heartbeat: after another engine gave
    memory back and it took some, it is not over what it may hold (a stale cap from the
    heartbeat before made it trim and preempt its own requests)."""
    ledger = Ledger(tmp_path / "l.json")
    ledger.set_total_limit(100 * MiB)
    a, b = ledger.register("a"), ledger.register("b")
    assert a.try_acquire(80 * MiB)
    assert b.report(0).allowed_bytes == 20 * MiB
    a.release(60 * MiB)
    assert b.try_acquire(50 * MiB)
    assert b.allowed_bytes == 80 * MiB >= b.held_bytes


def test_an_engine_waits_for_memory_while_it_keeps_arriving(monkeypatch):
    from kvmem.memory import budget

    now = [0.0]
    monkeypatch.setattr(budget.time, "monotonic", lambda: now[0])
    wait = budget.MemoryWait(wait_s=5)
    assert not wait(False, 100)  # nothing asked for: preempt as usual
    assert wait(True, 100)
    now[0] = 4.9
    assert wait(True, 100)
    now[0] = 5.0
    assert not wait(True, 100)  # 5 s and none arrived: stop waiting
    assert wait(True, 120)  # some arrived: wait again
    now[0] = 9.9
    assert wait(True, 120)
