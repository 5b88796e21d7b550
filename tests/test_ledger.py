"""The shared budget: ledger bookkeeping, two engine processes sharing one limit, and the
``kvmem top`` / ``kvmem limit`` commands."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvmem.cli import main
from kvmem.errors import ConfigError
from kvmem.memory.ledger import Ledger, LedgerError, UnknownEngineError

ENGINE = textwrap.dedent("""
    import sys, torch
    from kvmem.memory.elastic import ElasticKVStorage
    from kvmem.memory.ledger import Ledger
    from kvmem.memory.storage import SlotShape

    name, ledger_dir, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    budget = Ledger.for_device("cpu", ledger_dir).register(name, total_limit=total)
    storage = ElasticKVStorage(2, SlotShape(2, 16, 4, 64), torch.float16, max_blocks=4096,
                               budget=budget, reserve_pages=1, min_page_bytes=64 * 1024)
    queue = storage.free_queue()
    live = []
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "grab":  # take blocks until the shared budget says no
            while storage.capacity_guard(8):
                got = queue.pop_n(8)
                storage.on_blocks_allocated(got)
                storage.slot_tensor(0)[got] = 1.0
                live += got
        elif cmd == "release":
            storage.on_blocks_released(live)
            queue.push_free(live)
            live = []
            storage.settle()
        elif cmd == "quit":
            break
        print(len(live), storage.stats().held_bytes, flush=True)
    storage.close()
""")


def test_register_acquire_release_and_limits(tmp_path):
    ledger = Ledger(tmp_path / "l.json")
    a = ledger.register("a", ceiling_bytes=1000)
    b = ledger.register("b", total_limit=1500)
    assert a.try_acquire(800)
    assert not a.try_acquire(300)  # own limit
    assert b.try_acquire(700)
    assert not b.try_acquire(1)  # device total: 800 + 700 already held
    a.release(500)
    assert b.try_acquire(400)
    code = ("import sys, time; from kvmem.memory.ledger import Ledger; "
            "Ledger(sys.argv[1]).register('c'); print('in', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "l.json")],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "in"
        with pytest.raises(ConfigError, match="already uses"):
            ledger.register("c")  # a live engine of another process owns the name
    finally:
        other.kill()
        other.wait()
    with pytest.raises(UnknownEngineError):
        ledger.set_limits("nope", ceiling_bytes=10)
    state = a.report(123)
    # a may hold what the device total leaves it (1500 - b's 1100), within its ceiling
    assert (state.held_bytes, state.allowed_bytes) == (300, 400)
    assert {e.name: e.live_bytes for e in ledger.entries()} == {"a": 123, "b": 0}  # c reaped


def test_dead_engines_are_reaped(tmp_path):
    code = ("import sys; from kvmem.memory.ledger import Ledger; "
            "Ledger(sys.argv[1]).register('gone').try_acquire(10**9)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "l.json")], check=True,
                   timeout=60)
    ledger = Ledger(tmp_path / "l.json")
    assert ledger.entries() == []  # its pid no longer exists
    budget = ledger.register("gone", total_limit=2 * 10**9)  # the name is free again
    assert budget.try_acquire(2 * 10**9)  # and its bytes were returned


class Engine:
    def __init__(self, name: str, tmp_path, total: int) -> None:
        script = tmp_path / "engine.py"
        script.write_text(ENGINE)
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), name, str(tmp_path), str(total)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def send(self, cmd: str) -> tuple[int, int]:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        blocks, held = self.proc.stdout.readline().split()
        return int(blocks), int(held)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(30)
        assert self.proc.returncode == 0


def test_a_held_lock_is_tried_again_soon_then_less_often_and_never_waited_on_for_ever(
        tmp_path, monkeypatch):
    """Another engine holds the ledger's lock for a tenth of a millisecond or two: the
    next try comes after 25 us, the waits double up to a millisecond (a fixed millisecond
    cost an answer that much per write), and a lock held past the timeout is an error."""
    import fcntl

    from kvmem.memory import ledger as ledger_module

    ledger = Ledger(tmp_path / "l.json")
    ledger.register("a")
    holder = os.open(tmp_path / "l.json", os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)  # another open file: the same process conflicts
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 8:
            fcntl.flock(holder, fcntl.LOCK_UN)  # the other engine is done

    monkeypatch.setattr(ledger_module.time, "sleep", sleep)
    try:
        assert "a" in ledger.read().engines
        assert pauses == [25e-6 * 2 ** i for i in range(6)] + [1e-3, 1e-3]
        fcntl.flock(holder, fcntl.LOCK_EX)
        monkeypatch.setattr(ledger_module, "LOCK_TIMEOUT_S", 0.0)
        with pytest.raises(LedgerError, match="stayed locked"):
            ledger.read()
    finally:
        os.close(holder)


def test_two_engines_share_one_budget(tmp_path):
    total = 64 << 20
    a, b = Engine("a", tmp_path, total), Engine("b", tmp_path, total)
    ledger = Ledger.for_device("cpu", tmp_path)
    try:
        a_blocks, a_held = a.send("grab")  # a takes nearly everything
        b_blocks, b_held = b.send("grab")  # b gets only what is left
        assert a_held + b_held <= total
        assert sum(e.mapped_bytes for e in ledger.entries()) <= total
        assert b_blocks < a_blocks / 4
        _, a_idle = a.send("release")  # a idles and gives its pages back
        assert a_idle < total / 8
        b_more, b_held = b.send("grab")  # now b can grow
        assert b_more > 4 * b_blocks
        assert a_idle + b_held <= total
        a_again, a_held = a.send("grab")  # both busy: neither passes the shared limit
        assert a_held + b_held <= total
        assert sum(e.mapped_bytes for e in ledger.entries()) <= total
        assert a_again < a_blocks
    finally:
        a.close()
        b.close()


def test_flush_writes_releases_held_back_by_an_answer_in_flight(tmp_path):
    """Releases made while another thread answers an ask wait for that answer's write;
    ``flush`` (what ``ElasticKVStorage.settle`` ends with) waits for the answer, then has
    the ledger count them. Without it another engine can be refused bytes already freed:
    the two-engine test above failed that way on a loaded machine."""
    ledger = Ledger(tmp_path / "l.json")
    budget = ledger.register("a", total_limit=1000)
    assert budget.try_acquire(800)
    inside, leave = threading.Event(), threading.Event()

    def answer() -> None:
        with budget.answering():
            inside.set()
            leave.wait(30)

    answering = threading.Thread(target=answer)
    answering.start()
    assert inside.wait(30)
    budget.release(500)  # written with the answer
    assert ledger.entries()[0].mapped_bytes == 800
    flush = threading.Thread(target=budget.flush)
    flush.start()
    flush.join(0.2)
    assert flush.is_alive()  # waiting for the answer
    leave.set()
    flush.join(30)
    answering.join(30)
    assert not flush.is_alive()
    assert ledger.entries()[0].mapped_bytes == 300
    assert ledger.register("b", total_limit=1000).try_acquire(700)


def test_top_and_limit_commands(tmp_path, capsys):
    ledger = Ledger.for_device("cuda:0", tmp_path)  # an engine on cuda:0 made it
    budget = ledger.register("llama", ceiling_bytes=4 << 30)
    budget.try_acquire(3 << 30)
    budget.report(1 << 30, 1 << 29)
    assert main(["top", "--json", "--ledger-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    [device] = doc["devices"]
    assert device["device"] == "cuda:0" and device["total_bytes"] is None
    assert [(e["name"], e["mapped_bytes"], e["live_bytes"], e["cached_bytes"],
             e["ceiling_bytes"], e["floor_bytes"]) for e in device["engines"]] == \
        [("llama", 3 << 30, 1 << 30, 1 << 29, 4 << 30, 0)]
    assert main(["top", "--ledger-dir", str(tmp_path)]) == 0
    assert "llama" in capsys.readouterr().out

    assert main(["limit", "llama", "2GiB", "--ledger-dir", str(tmp_path)]) == 0
    assert ledger.entries()[0].ceiling_bytes == 2 << 30
    assert not budget.try_acquire(1)  # 3 GiB held is now above the limit
    assert main(["limit", "--total", "8GiB", "--device", "cuda:0",
                 "--ledger-dir", str(tmp_path)]) == 0
    assert ledger.total_limit() == 8 << 30
    capsys.readouterr()

    assert main(["limit", "mistral", "2GiB", "--ledger-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvmem: error:") and "mistral" in err and err.count("\n") == 1
    assert main(["limit", "llama", "lots", "--ledger-dir", str(tmp_path)]) == 2
    assert "cannot read 'lots'" in capsys.readouterr().err


@pytest.mark.parametrize(("device", "message"), [
    ("cuda:99", "--device cuda:99: this machine has 0 CUDA devices"),
    ("tpu", "--device must be cpu or cuda:N (as kvmem top shows it), got 'tpu'"),
    ("../../etc", "--device must be cpu or cuda:N (as kvmem top shows it), got '../../etc'"),
    ("cuda:x", "--device must be cpu or cuda:N (as kvmem top shows it), got 'cuda:x'"),
])
def test_limit_refuses_a_device_this_machine_does_not_have(tmp_path, capsys, monkeypatch,
                                                           device, message):
    """`kvmem limit --total` used to write a ledger for any device name; a path-like one
    must never lead out of the ledger folder either."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    ledgers = tmp_path / "ledgers"
    ledgers.mkdir()
    for args in (["--total", "1GiB", "--device", device], ["llama", "1GiB", "--device", device]):
        assert main(["limit", *args, "--ledger-dir", str(ledgers)]) == 2
        err = capsys.readouterr().err
        assert err == f"kvmem: error: {message}\n"
    assert list(tmp_path.rglob("*.json")) == []
    assert main(["limit", "--total", "1GiB", "--device", "cpu", "--ledger-dir",
                 str(ledgers)]) == 0
    assert [p.name for p in tmp_path.rglob("*.json")] == ["kvmem-ledger-cpu.json"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # a machine with one GPU
    assert main(["limit", "--total", "1GiB", "--device", "cuda", "--ledger-dir",
                 str(ledgers)]) == 0
    assert Ledger.for_device("cuda:0", ledgers).total_limit() == 1 << 30


def test_an_engine_on_a_bare_cuda_device_registers_where_limit_looks(monkeypatch):
    import torch

    from kvmem.engine.elastic_setup import ledger_device_name

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert ledger_device_name(torch.device("cuda")) == "cuda:0"  # what limit's "cuda" names
    assert ledger_device_name(torch.device("cuda", 3)) == "cuda:3"
    assert ledger_device_name(torch.device("cpu")) == "cpu"


def test_a_ledger_name_never_leaves_the_ledger_folder(tmp_path):
    for device in ("../../etc", "cuda:0/../../x", "ｃｐｕ／..", "a\x00b"):
        assert Ledger.for_device(device, tmp_path).path.parent == tmp_path


def test_top_refuses_watch_intervals_it_cannot_sleep(capsys):
    for value in ("1e400", "-1", "nan", "0", "inf", "x"):
        with pytest.raises(SystemExit) as done:
            main(["top", "--watch", value])
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("kvmem: error: argument --watch:") and err.count("\n") == 1


def test_a_ledger_that_is_not_a_regular_file_or_too_large_is_refused(tmp_path):
    os.symlink("/dev/zero", tmp_path / "kvmem-ledger-cpu.json")
    with pytest.raises(LedgerError, match="a link, refused"):
        Ledger.for_device("cpu", tmp_path).entries()
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "kvmem-ledger-cpu.json")  # opened without blocking, then refused
    with pytest.raises(LedgerError, match="not a regular file"):
        Ledger.for_device("cpu", fifo).entries()
    big = tmp_path / "big"
    big.mkdir()
    with open(big / "kvmem-ledger-cpu.json", "wb") as f:
        f.truncate(1 << 30)  # sparse: no disk used
    with pytest.raises(LedgerError, match="larger than a KV memory ledger"):
        Ledger.for_device("cpu", big).total_limit()


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"[]", b'{"engines": []}',
                                     b'{"total_limit": 5, "engines": 7}', b"{torn"])
def test_a_foreign_or_torn_ledger_starts_a_fresh_table(tmp_path, content):
    path = tmp_path / "kvmem-ledger-cpu.json"
    path.write_bytes(content)
    ledger = Ledger.for_device("cpu", tmp_path)
    assert ledger.entries() == [] and ledger.read().damage  # described, not fixed
    ledger.register("a")
    assert [e.name for e in ledger.entries()] == ["a"]
    assert ledger.read().damage == []  # the next write repaired it


@pytest.mark.parametrize("lose", ["delete", "reset"])
def test_an_engine_whose_entry_is_lost_registers_again(tmp_path, lose):
    """A ledger file deleted or reset under a running engine: its next call registers it
    again with what it holds and its limit, instead of raising UnknownEngineError."""
    path = tmp_path / "l.json"
    a = Ledger(path).register("a", ceiling_bytes=1000)
    assert a.try_acquire(600)
    if lose == "delete":
        path.unlink()
    else:
        path.write_text("{}")
    assert not a.try_acquire(500)  # 600 still held: the limit still applies
    assert a.try_acquire(300)
    assert [(e.name, e.mapped_bytes, e.ceiling_bytes) for e in Ledger(path).entries()] == \
        [("a", 900, 1000)]
    path.unlink()
    a.release(400)
    state = a.report(7)
    assert (state.held_bytes, state.allowed_bytes) == (500, 1000)


def test_an_unopenable_ledger_directory_is_a_one_line_error(tmp_path, capsys):
    """kvmem generate --kv-memory elastic with KVMEM_LEDGER_DIR where nothing can be created:
    one line, exit 2, no traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "KVMEM_LEDGER_DIR": str(tmp_path / "file" / "sub")}
    (tmp_path / "file").write_text("not a directory")
    done = subprocess.run([sys.executable, "-m", "kvmem", "generate", "--kv-memory", "elastic",
                           "--max-tokens", "1", "hi"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot open the KV memory ledger" in lines[0], done.stderr


# -- a ledger damaged or attacked while engines run -------------------------------------
@pytest.mark.parametrize("content", [
    b'{"engines": {"x": 5}}',
    b'{"total_limit": "abc", "engines": {}}',
    b'{"engines": {"a": {"pid": 99999999999999999999}}}',
    b'{"engines": {"a": {"pid": 4000000, "heartbeat": "now"}}}',
    b'{"engines": {"a": {"pid": 4000000, "mapped_bytes": -4}}}',
    b'{"engines": {"a": {"name": "a"}}}',
    b'{"engines": {"\\u0000bad": {"pid": 1}}}',
])
def test_a_ledger_of_the_wrong_shape_never_stops_an_engine(tmp_path, content, capsys):
    """Every entry and field is validated: a bad one is dropped (and described for
    `kvmem top`); the engine's own entry is put right at its next write."""
    path = tmp_path / "kvmem-ledger-cpu.json"
    budget = Ledger.for_device("cpu", tmp_path).register("a", ceiling_bytes=1000)
    assert budget.try_acquire(300)
    path.write_bytes(content)
    ledger = Ledger.for_device("cpu", tmp_path)
    assert ledger.read().damage
    assert main(["top", "--ledger-dir", str(tmp_path)]) == 0
    assert "is damaged" in capsys.readouterr().out
    assert main(["top", "--json", "--ledger-dir", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["devices"][0]["damage"]
    assert budget.try_acquire(600)  # goes on, its 300 still counted
    assert not budget.try_acquire(200)
    [entry] = ledger.entries()
    assert (entry.name, entry.mapped_bytes, entry.pid) == ("a", 900, os.getpid())
    assert ledger.read().damage == []


def test_a_ledger_replaced_by_a_directory_leaves_the_engine_its_own_accounting(tmp_path, caplog):
    path = tmp_path / "kvmem-ledger-cpu.json"
    budget = Ledger.for_device("cpu", tmp_path).register("a", ceiling_bytes=1000)
    assert budget.try_acquire(300)
    budget.report(100)
    path.unlink()
    path.mkdir()
    with caplog.at_level("WARNING", logger="kvmem.memory"):
        assert budget.try_acquire(600)  # within the 1000 it was last allowed
        assert not budget.try_acquire(200)
        budget.report(500)
        budget.release(100)
    problems = [r for r in caplog.records if "own accounting" in r.getMessage()]
    assert len(problems) == 1  # logged once, not per call
    path.rmdir()
    with caplog.at_level("WARNING", logger="kvmem.memory"):
        assert budget.try_acquire(100)
    assert any("usable again" in r.getMessage() for r in caplog.records)
    assert [(e.name, e.mapped_bytes) for e in Ledger.for_device("cpu", tmp_path).entries()] == \
        [("a", 900)]


def test_the_ledger_never_follows_a_link(tmp_path):
    """In a world-writable folder another user could plant a link named like the ledger:
    neither an engine nor `kvmem limit` may rewrite its target."""
    target = tmp_path / "victim"
    target.write_text("precious")
    folder = tmp_path / "ledgers"
    folder.mkdir()
    os.symlink(target, folder / "kvmem-ledger-cpu.json")
    with pytest.raises(LedgerError, match="a link, refused"):
        Ledger.for_device("cpu", folder).register("a")
    assert main(["limit", "--total", "1GiB", "--device", "cpu", "--ledger-dir",
                 str(folder)]) == 2
    assert target.read_text() == "precious"


def test_ledger_files_are_private_unless_the_folder_is_a_group_folder(tmp_path):
    private = tmp_path / "private"
    Ledger.for_device("cpu", private).register("a")
    assert (private / "kvmem-ledger-cpu.json").stat().st_mode & 0o777 == 0o600
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o2770)  # set-group-ID: engines of one group share its ledgers
    Ledger.for_device("cpu", group).register("a")
    assert (group / "kvmem-ledger-cpu.json").stat().st_mode & 0o777 == 0o660


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_ledger_of_another_user_is_not_touched(tmp_path):
    path = tmp_path / "kvmem-ledger-cpu.json"
    path.write_text('{"total_limit": 5}')
    os.chown(path, 65534, 65534)
    with pytest.raises(LedgerError, match="belongs to user 65534"):
        Ledger.for_device("cpu", tmp_path).register("a")
    assert path.read_text() == '{"total_limit": 5}'


def test_top_and_limit_refuse_a_ledger_folder_that_is_a_file(tmp_path, capsys):
    folder = tmp_path / "file"
    folder.write_text("x")
    for args in (["top"], ["top", "--json"], ["limit", "a", "1GiB"]):
        assert main([*args, "--ledger-dir", str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvmem: error:") and "not a directory" in err


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs (needs the right to mount; skipped without it)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_tmpfs_under_the_ledger_leaves_it_intact(tiny_tmpfs):
    """A write that finds no room fails before touching the table (an engine then goes on
    with its own accounting); the ledger as it was stays readable."""
    ledger = Ledger.for_device("cpu", tiny_tmpfs)
    budget = ledger.register("a", ceiling_bytes=1 << 20)
    assert budget.try_acquire(4096)
    path = tiny_tmpfs / "kvmem-ledger-cpu.json"
    while path.stat().st_size < 3600:  # the next entry needs a second 4 KiB page
        ledger.register(f"b{path.stat().st_size}")
    filler = tiny_tmpfs / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    before = path.read_bytes()
    with pytest.raises(LedgerError, match="left as it was"):
        ledger.register("c" * 128)
    assert path.read_bytes() == before
    assert budget.try_acquire(4096)  # the engine goes on with its own accounting
    filler.unlink()
    assert budget.try_acquire(4096)  # and back in the ledger with all it holds
    assert ledger.read().engines["a"].mapped_bytes == 3 * 4096


def test_engine_names_are_printable_and_shown_as_text(tmp_path, capsys):
    ledger = Ledger.for_device("cpu", tmp_path)
    for bad in ("", "a\nb", "x" * 129, "\x1b[31mred"):
        with pytest.raises(ConfigError, match="printable characters"):
            ledger.register(bad)
    ledger.register("[/x]")
    ledger.register("[bold red]y[/]")
    assert main(["top", "--ledger-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[/x]" in out and "[bold red]y[/]" in out


def test_an_engine_killed_and_not_yet_waited_for_gives_its_room_at_once(tmp_path):
    """kill -9 of an engine whose parent has not reaped it yet (a zombie) holds no memory:
    the others get its room at their next look at the ledger."""
    code = ("import sys, time; from kvmem.memory.ledger import Ledger; "
            "b = Ledger(sys.argv[1]).register('held'); b.try_acquire(900); "
            "print('in', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "l.json")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "in"
        ledger = Ledger(tmp_path / "l.json")
        ledger.set_total_limit(1000)
        other = ledger.register("other")
        assert not other.try_acquire(500)
        proc.kill()  # not waited for: a zombie until the end of this test
        deadline = time.monotonic() + 60
        while not other.try_acquire(500):
            assert time.monotonic() < deadline, "the killed engine's room never came back"
            time.sleep(0.01)
        assert [e.name for e in ledger.entries()] == ["other"]
    finally:
        proc.kill()
        proc.wait()
