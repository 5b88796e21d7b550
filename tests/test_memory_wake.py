"""Engines on one device wake each other when one asks another for memory (and when a
limit of theirs changes), rather than each polling the ledger."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from kvmem.memory import control, wake
from kvmem.memory.backends import FakeBackend
from kvmem.memory.elastic import ElasticKVStorage
from kvmem.memory.ledger import Ledger
from kvmem.memory.storage import SlotShape

MiB = 1 << 20
SHAPE = SlotShape(num_kv=2, block_size=16, num_heads=2, head_dim=32)


def test_an_engine_asked_for_memory_is_woken(tmp_path):
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(10 * MiB)
    a = ledger.register("a")
    woken = threading.Event()
    assert a.listen(woken.set)
    try:
        assert a.try_acquire(8 * MiB)  # held, idle: all of it givable
        b = ledger.register("b")
        assert not b.try_acquire(6 * MiB)  # the total refuses: a is asked, and woken
        assert woken.wait(5)
        entry = ledger.read().engines["a"]
        assert entry.reclaim_bytes == 4 * MiB and entry.asked_at > 0
    finally:
        a.close()


def test_an_engine_that_waits_for_memory_wakes_the_engine_it_asks(tmp_path):
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(10 * MiB)
    a, b = ledger.register("a"), ledger.register("b")
    woken = threading.Event()
    a.listen(woken.set)
    try:
        assert a.try_acquire(8 * MiB)
        assert b.want(6 * MiB)
        assert woken.wait(5)
    finally:
        a.close()


def test_an_answer_records_how_long_after_the_ask_it_came(tmp_path):
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(10 * MiB)
    a, b = ledger.register("a"), ledger.register("b")
    assert a.try_acquire(8 * MiB)
    assert not b.try_acquire(6 * MiB)
    asked = time.time()
    time.sleep(0.02)
    a.release(4 * MiB)
    a.gave_back(4 * MiB, a.peek())
    entry = ledger.read().engines["a"]
    assert entry.reclaim_bytes == 0 and entry.asked_at == 0
    assert 0.02 <= entry.answered_s <= time.time() - asked + 0.01
    assert a.answered_s == entry.answered_s
    assert b.try_acquire(6 * MiB)


def test_a_changed_limit_wakes_its_engine(tmp_path):
    ledger = Ledger.for_device("cpu", tmp_path)
    a = ledger.register("a")
    woken = threading.Event()
    a.listen(woken.set)
    try:
        control.set_limits("a", ceiling_bytes=64 * MiB, ledger_dir=tmp_path)
        assert woken.wait(5)
        woken.clear()
        control.set_total("cpu", 128 * MiB, ledger_dir=tmp_path)
        assert woken.wait(5)
    finally:
        a.close()


def test_the_wake_address_names_one_engine_of_one_process_in_one_ledger(tmp_path):
    base = wake.address(tmp_path / "l.json", "a", 100, 5)
    assert base.startswith("\0kvmem-wake-")
    assert len({base, wake.address(tmp_path / "m.json", "a", 100, 5),
                wake.address(tmp_path / "l.json", "b", 100, 5),
                wake.address(tmp_path / "l.json", "a", 101, 5),
                wake.address(tmp_path / "l.json", "a", 100, 6)}) == 5


def test_waking_an_engine_that_is_gone_neither_waits_nor_fails(tmp_path):
    gone = wake.address(tmp_path / "l.json", "gone", os.getpid(), 1)
    start = time.monotonic()
    assert wake.wake([gone]) == 0
    assert time.monotonic() - start < 1


def test_a_full_queue_of_wake_ups_does_not_block_the_sender(tmp_path):
    """A listener stuck in its callback: senders go on at once (a wake-up is queued)."""
    release = threading.Event()
    listener = wake.WakeListener(wake.address(tmp_path / "l.json", "a", 1, 1),
                                 lambda: release.wait(10))
    try:
        start = time.monotonic()
        for _ in range(2000):  # more than a datagram socket's queue holds
            wake.wake([listener.address])
        assert time.monotonic() - start < 5
    finally:
        release.set()
        listener.close()


def test_a_name_taken_by_another_socket_falls_back_to_polling(tmp_path, caplog):
    address = wake.address(tmp_path / "l.json", "a", 1, 1)
    squatter = wake.WakeListener(address, lambda: None)
    try:
        assert wake.WakeListener.start(address, lambda: None) is None
        assert "cannot listen for KV memory wake-ups" in caplog.text
    finally:
        squatter.close()


def test_no_wake_ups_when_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMEM_MEMORY_WAKE", "0")
    budget = Ledger.for_device("cpu", tmp_path).register("a")
    assert not budget.listen(lambda: None)
    budget.close()


def test_closing_a_listener_ends_its_thread(tmp_path):
    before = threading.active_count()
    listener = wake.WakeListener(wake.address(tmp_path / "l.json", "a", 1, 1), lambda: None)
    assert threading.active_count() == before + 1
    listener.close()
    assert threading.active_count() == before


def idle_storage(tmp_path) -> tuple[Ledger, ElasticKVStorage, int]:
    """Engine ``a``'s storage (not started) under a device total of 8 of its pages."""
    ledger = Ledger.for_device("cpu", tmp_path)
    storage = ElasticKVStorage(3, SHAPE, torch.float32, max_blocks=64, backend=FakeBackend(4096),
                               blocks_per_page=4, reserve_pages=4, start=False,
                               budget=ledger.register("a"))
    page = storage.geometry.page_bytes
    ledger.set_total_limit(8 * page)
    return ledger, storage, page


@pytest.mark.parametrize("woken", [True, False], ids=["woken", "polled"])
def test_an_idle_storage_answers_an_ask_without_waiting_for_its_heartbeat(tmp_path,
                                                                           monkeypatch, woken):
    """Its heartbeat is pushed an hour away: only the wake-up (or, with wake-ups switched
    off, the 50 ms look at the ledger) can make it answer."""
    if not woken:
        monkeypatch.setenv("KVMEM_MEMORY_WAKE", "0")
    ledger, storage, page = idle_storage(tmp_path)
    storage.start()
    try:
        storage.settle()
        assert storage.stats().held_bytes >= 5 * page  # the null page and 4 ahead
        storage._premap.interval = 3600.0  # no heartbeat from here on
        answered = threading.Event()
        gave_back = storage.budget.gave_back
        storage.budget.gave_back = lambda n, s, **kw: (gave_back(n, s, **kw), answered.set())
        b = ledger.register("b")
        assert not b.try_acquire(6 * page)
        assert answered.wait(5)
        assert b.try_acquire(6 * page)
        assert ledger.read().engines["a"].answered_s < 5
    finally:
        storage.close()


def test_vllms_ledger_watch_wakes_the_engine_core_when_its_engine_is_asked(tmp_path,
                                                                          monkeypatch):
    """An idle vLLM engine takes no step: the watch in its engine core process is woken
    by the engine that asks it for memory and wakes the core loop at once (its own look
    at the ledger, for a ceiling lowered by hand, is pushed an hour away here)."""
    from kvmem.integrations.vllm.elastic import watch as watch_module

    monkeypatch.setattr(watch_module, "LIMIT_INTERVAL_S", 3600.0)
    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(10 * MiB)
    a = ledger.register("a")
    core = threading.Event()
    watch = watch_module.LedgerWatch(a, lambda: a.held_bytes, wake=lambda: core.set() or True)
    try:
        assert watch.interval == 3600.0  # it listens
        assert a.try_acquire(8 * MiB)
        assert not ledger.register("b").try_acquire(6 * MiB)
        assert core.wait(5)
        assert watch.wakes >= 1
    finally:
        watch.stop()
        a.close()


def _flood(address: str, seconds: float) -> int:
    """Send empty datagrams to ``address`` for ``seconds``; how many were delivered."""
    delivered, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        delivered += wake.wake([address] * 100)
    return delivered


def test_a_flood_of_wake_ups_is_coalesced(tmp_path):
    """Any local process can send to the socket: the engine looks at the ledger at most
    once per MIN_GAP_S however many datagrams (of any size) arrive."""
    calls = []
    listener = wake.WakeListener(wake.address(tmp_path / "l.json", "a", 1, 1),
                                 lambda: calls.append(time.monotonic()))
    try:
        seconds = 0.5
        delivered = _flood(listener.address, seconds)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as big:
            big.sendto(b"x" * 60000, listener.address)  # read one byte of it, all dropped
        time.sleep(0.1)
        assert delivered > 4 * seconds / wake.MIN_GAP_S  # the flood was delivered
        assert 1 <= len(calls) <= seconds / wake.MIN_GAP_S + 5
        assert listener._thread.is_alive()
    finally:
        listener.close()
    assert not listener._thread.is_alive()


def _send_as_nobody(address: str, count: int) -> None:
    """Send ``count`` wake-ups to ``address`` from a child process of another user."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.setgid(65534)
            os.setuid(65534)
            for _ in range(count):
                wake.wake([address])
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def test_wake_ups_from_anyone_wake_vllms_engine_core_only_when_the_ledger_asks(tmp_path):
    """A wake-up is a hint: datagrams from another local user (any process can send to an
    abstract socket) put nothing on vLLM's input queue while the ledger asks nothing."""
    from kvmem.integrations.vllm.elastic import watch as watch_module

    ledger = Ledger.for_device("cpu", tmp_path)
    ledger.set_total_limit(10 * MiB)
    a = ledger.register("a")
    core = []
    watch = watch_module.LedgerWatch(a, lambda: a.held_bytes,
                                     wake=lambda: core.append(1) or True)
    try:
        assert a.try_acquire(8 * MiB)
        if os.geteuid() == 0:
            _send_as_nobody(a.address(), 300)
        _flood(a.address(), 0.2)
        time.sleep(0.1)
        assert core == []
        assert not ledger.register("b").try_acquire(6 * MiB)  # a real ask still wakes it
        deadline = time.monotonic() + 5
        while not core and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core
    finally:
        watch.stop()
        a.close()


def count_heartbeats(budget) -> list[float]:
    """When each of ``budget``'s heartbeats (``report``: a ledger write) came, from now."""
    beats: list[float] = []
    report = budget.report
    budget.report = lambda *a: (beats.append(time.monotonic()), report(*a))[1]
    return beats


def ask_for_six_pages(ledger, page: int, handed: list):
    """Engine ``b`` asks for six pages (an ask of ``a``, and a wake-up); once ``a`` handed
    it over to ``handed``: ``b`` and a deadline 5 s from the ask."""
    b = ledger.register("b")
    assert not b.try_acquire(6 * page)
    deadline = time.monotonic() + 5
    while not handed:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return b, deadline


def test_an_ask_is_handed_to_the_engine_from_the_wake_up_itself(tmp_path):
    """The wake-up's thread reads the ask and hands it over: no heartbeat (a ledger write)
    and no hop to the pre-mapping thread before the engine answers. The answer's write
    then tells the ledger what the engine holds live and cached, as a heartbeat would
    (what the next ask of it is measured against)."""
    ledger, storage, page = idle_storage(tmp_path)
    handed: list = []
    storage.start(on_due=lambda state: handed.append((threading.current_thread().name, state)))
    budget = storage.budget
    try:
        storage.settle()
        storage._premap.interval = 3600.0  # heartbeats only when woken
        budget.report(3 * page, page)  # what an earlier heartbeat said: out of date now
        beats = count_heartbeats(budget)
        b, deadline = ask_for_six_pages(ledger, page, handed)
        assert [name for name, _ in handed] == ["kvmem-wake"] and beats == []
        storage.answer(handed[0][1])
        entry = ledger.read().engines["a"]
        assert (entry.live_bytes, entry.cached_bytes) == storage.table.usage_bytes() \
            != (3 * page, page)
    finally:
        storage.close()


def test_wake_ups_while_the_engines_answer_is_on_its_way_wait_for_it(tmp_path):
    """The engine answers on its own thread, later (``on_due``): the asker's wake-ups
    meanwhile send no heartbeat (each would write the ledger beside the answer), and one
    comes at once when the answer is given, for what was asked meanwhile."""
    ledger, storage, page = idle_storage(tmp_path)
    handed: list = []
    storage.start(on_due=handed.append)  # the engine's loop would answer at its step end
    budget = storage.budget
    try:
        storage.settle()
        storage._premap.interval = 3600.0  # heartbeats only when woken
        beats = count_heartbeats(budget)
        b, deadline = ask_for_six_pages(ledger, page, handed)
        time.sleep(0.05)
        seen = len(beats)
        for _ in range(5):  # the asker, waiting, wakes it at each of its steps
            wake.wake([budget.address()])
            time.sleep(0.02)
        time.sleep(0.2)
        assert len(beats) == seen  # none while the answer is owed
        storage.answer(handed[-1])
        while len(beats) == seen:  # the deferred one, at once
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert b.try_acquire(6 * page)
        seen = len(beats)
        wake.wake([budget.address()])  # nothing owed now: woken as usual
        while len(beats) == seen:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        storage.close()
