"""``kvmem top`` on engines in odd states and hostile ledgers, and the output of ``kvmem
top`` and ``kvmem vllm-check`` to a closed pipe, an ASCII-only terminal or a file: an idle
vLLM engine (no step, so no heartbeat) is not called stopped; an engine whose pid another
process took is; a ledger of 10,000 engines is shown in bounded lines; each server's
/metrics is read once per screen; a reader that goes away ends the command quietly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hostile_http import RawServer, reply, within
from test_tier_verdict import VLLM_PAGE

from kvmem.cli import main
from kvmem.cli import top as top_command
from kvmem.cli.top import MAX_ENGINES, MAX_NOTES, MAX_SERVERS
from kvmem.memory.ledger import Ledger

ROOT = Path(__file__).parent.parent


def set_heartbeat(ledger: Ledger, name: str, at: float) -> None:
    def change(table):
        table.engines[name].heartbeat = at

    ledger.change(change)


def top(capsys, tmp_path: Path, *extra: str) -> str:
    assert main(["top", "--ledger-dir", str(tmp_path), *extra]) == 0
    return capsys.readouterr().out


def test_an_idle_engine_without_heartbeats_is_idle_and_a_busy_one_stuck(tmp_path, capsys,
                                                                        monkeypatch):
    """An idle vLLM engine runs no step, so it writes no heartbeat: without running
    requests' KV that is idle, not stopped; with them, it may be stuck."""
    started = time.time() - 3600  # the engines' process (this one) ran before its beats
    monkeypatch.setattr(top_command, "_started_at", lambda pid: started)
    ledger = Ledger.for_device("cpu", tmp_path)
    idle, busy = ledger.register("idle"), ledger.register("busy")
    try:
        busy.report(1 << 20, 0)
        for name in ("idle", "busy"):
            set_heartbeat(ledger, name, time.time() - 30)
        out = top(capsys, tmp_path)
        assert "idle:" not in out and "stopped" not in out
        assert "busy: holds running requests' KV, but no heartbeat for 30 s (stuck?)" in out
    finally:
        idle.close()
        busy.close()


def test_an_engine_whose_pid_another_process_took_is_stopped(tmp_path, capsys):
    psutil = pytest.importorskip("psutil")
    ledger = Ledger.for_device("cpu", tmp_path)
    budget = ledger.register("gone")
    try:  # this process started after the entry's last heartbeat: not that engine
        set_heartbeat(ledger, "gone", psutil.Process().create_time() - 100)
        out = top(capsys, tmp_path)
        assert f"gone: stopped: pid {os.getpid()} is another process now" in out
    finally:
        budget.close()


def test_ten_thousand_engines_of_pid_1_are_shown_in_bounded_lines(tmp_path, capsys):
    """Ages no engine can have (a heartbeat at 0, before the machine started) are '?'."""
    (tmp_path / "kvmem-ledger-cpu.json").write_text(json.dumps(
        {"engines": {f"e{i:05}": {"pid": 1} for i in range(10_000)}}))
    out = within(60, lambda: top(capsys, tmp_path))
    assert len(out.splitlines()) <= 5 + MAX_ENGINES + MAX_NOTES + 2  # title, head, rule
    assert f"and {10_000 - MAX_ENGINES:,} more engines (kvmem top --json lists them all)" in out
    rows = [line for line in out.splitlines() if " cpu " in line]
    assert len(rows) == MAX_ENGINES and all(row.split()[-1] == "?" for row in rows)
    assert "1795" not in out and "no heartbeat for" not in out
    doc = json.loads(within(60, lambda: top(capsys, tmp_path, "--json")))
    assert len(doc["devices"][0]["engines"]) == 10_000


def test_three_hundred_damaged_ledgers_are_shown_in_bounded_lines(tmp_path, capsys):
    for i in range(300):
        (tmp_path / f"kvmem-ledger-cuda-{i}.json").write_text("garbage")
    out = top(capsys, tmp_path)
    assert len(out.splitlines()) == 1 + MAX_NOTES + 1
    assert out.count("is damaged (not a JSON document)") == MAX_NOTES
    assert out.endswith(f"and {300 - MAX_NOTES} more notes like these\n")


def test_each_server_is_read_once_per_screen(tmp_path, capsys):
    server = RawServer()
    server.default = reply("200 OK", VLLM_PAGE.encode(), Content_Type="text/plain")
    budget = Ledger.for_device("cpu", tmp_path).register("llama")
    try:
        assert "kvmem offload tiers" in top(capsys, tmp_path, "--metrics", server.url)
        assert server.requests == ["/metrics"]
    finally:
        budget.close()
        server.close()


def test_servers_are_read_at_once_and_each_once(tmp_path, capsys):
    """Each server answers only once all three are asked: read one after another, the
    first would wait in vain (and be an error row)."""
    servers = [RawServer() for _ in range(3)]
    all_asked = threading.Barrier(3, timeout=4)

    def answer(conn, head):
        all_asked.wait()
        reply("200 OK", VLLM_PAGE.encode(), Content_Type="text/plain")(conn, head)

    try:
        for server in servers:
            server.default = answer
        urls = [server.url for server in servers]
        argv = [a for url in [*urls, urls[0]] for a in ("--metrics", url)]
        rows = json.loads(top(capsys, tmp_path, "--json", *argv))["tiers"]
        assert [(r["server"], r.get("tier")) for r in rows] == \
            [(f"{url}/metrics", "cpu") for url in urls]
    finally:
        for server in servers:
            server.close()


def test_more_servers_than_a_screen_holds_are_refused(tmp_path, capsys):
    argv = [a for i in range(MAX_SERVERS + 1) for a in ("--metrics", f"http://h{i}")]
    assert main(["top", "--ledger-dir", str(tmp_path), *argv]) == 2
    assert capsys.readouterr().err == (f"kvmem: error: --metrics: at most {MAX_SERVERS} "
                                       f"servers, got {MAX_SERVERS + 1}\n")


# -- output ------------------------------------------------------------------------------------
def kvmem(*args: str, stdout=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmem", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **env})


def to_closed_pipe(*args: str) -> subprocess.CompletedProcess:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        return kvmem(*args, stdout=write)
    finally:
        os.close(write)


@pytest.mark.parametrize("args", [["top", "--json"], ["top"], ["vllm-check"],
                                  ["vllm-check", "--json"]])
def test_a_reader_that_closed_the_pipe_ends_it_quietly(tmp_path, args):
    budget = Ledger.for_device("cpu", tmp_path).register("llama")
    try:
        run = to_closed_pipe(*args, *(["--ledger-dir", str(tmp_path)] if "top" in args else []))
    finally:
        budget.close()
    assert (run.returncode, run.stderr) == (141, "")  # as a command ended by SIGPIPE


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["top", "--json"], ["top"], ["vllm-check"]])
def test_output_that_cannot_be_written_is_one_line(tmp_path, args):
    budget = Ledger.for_device("cpu", tmp_path).register("llama")
    try:
        with open("/dev/full", "w") as full:
            run = kvmem(*args, *(["--ledger-dir", str(tmp_path)] if "top" in args else []),
                        stdout=full)
    finally:
        budget.close()
    assert (run.returncode, run.stderr) == (
        2, "kvmem: error: cannot write the output: No space left on device\n")


def test_an_ascii_only_terminal_gets_characters_replaced(tmp_path):
    budget = Ledger.for_device("cpu", tmp_path).register("mod\u00e8le")
    server = RawServer()
    server.default = reply("200 OK", VLLM_PAGE.replace('tier="cpu"', 'tier="\u00e9"').encode(),
                           Content_Type="text/plain")
    try:
        ascii_only = {"PYTHONIOENCODING": "ascii"}
        run = kvmem("top", "--ledger-dir", str(tmp_path), **ascii_only)
        assert run.returncode == 0 and "mod?le" in run.stdout, run.stderr
        run = kvmem("vllm-check", "--stats", server.url, **ascii_only)
        assert run.returncode == 0 and "? tier (" in run.stdout, run.stderr
    finally:
        budget.close()
        server.close()


def test_watching_into_a_pipe_prints_one_screen_after_another(tmp_path):
    budget = Ledger.for_device("cpu", tmp_path).register("llama")
    proc = subprocess.Popen([sys.executable, "-m", "kvmem", "top", "--watch", "0.2",
                             "--ledger-dir", str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert within(60, lambda: _titles(proc, 2)) == 2
    finally:
        proc.kill()
        proc.wait()
        budget.close()


def _titles(proc: subprocess.Popen, wanted: int) -> int:
    """Screens read from ``proc``'s output, up to ``wanted``."""
    seen = 0
    for line in iter(proc.stdout.readline, ""):
        seen += "kvmem elastic KV memory" in line
        if seen == wanted:
            break
    return seen
