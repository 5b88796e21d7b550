"""``kvmem vllm-check --stats URL`` and ``kvmem top --metrics URL`` against hostile servers
and careless URLs (``kvmem.tiers.scrape``, ``kvmem.tiers.verdict``): a server that
trickles, never ends or is not HTTP, redirects, wrong content, figures no tier has,
markup and escape sequences. Each ends in a report, an error row (top) or one error line
(exit 2), never a traceback or a hang."""

from __future__ import annotations

import gzip
import json

import pytest
from hostile_http import RawServer, reply, within
from test_tier_verdict import VLLM_PAGE

from kvmem.cli import main, top, vllm_check
from kvmem.errors import KvmemError
from kvmem.tiers import scrape as scraping
from kvmem.tiers import verdict
from kvmem.tiers.scrape import scrape
from kvmem.tiers.verdict import read_figures

TEXT = "text/plain; version=0.0.4; charset=utf-8"


def page(text: str = VLLM_PAGE, status: str = "200 OK", **headers: str):
    return reply(status, text.encode(), Content_Type=TEXT, **headers)


@pytest.fixture
def raw():
    server = RawServer()
    yield server
    server.close()


@pytest.fixture
def quick(monkeypatch):
    """Both commands give a server 1 s."""
    monkeypatch.setattr(vllm_check, "SCRAPE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(top, "SCRAPE_TIMEOUT_S", 1.0)


def one_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kvmem: error: ") and err.count("\n") == 1, err
    return err


def top_rows(capsys, tmp_path, url: str) -> list[dict]:
    """``kvmem top --json --metrics url``'s tier rows (and the table drawn too)."""
    argv = ["top", "--ledger-dir", str(tmp_path), "--metrics", url]
    assert within(10, lambda: main(argv)) == 0
    assert "kvmem offload tiers" in capsys.readouterr().out
    assert within(10, lambda: main([*argv, "--json"])) == 0
    return json.loads(capsys.readouterr().out)["tiers"]


# -- one deadline per scrape ---------------------------------------------------------------
@pytest.mark.parametrize("sent", [
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nkvmem_", b"HTTP/1.1 200 OK\r\n", b""],
    ids=["body", "headers", "status line"])
def test_a_trickling_server_is_given_up_on_at_the_deadline(raw, sent):
    """A byte every 0.2 s never lets a per-read timeout fire; the deadline ends it."""
    raw.default = raw.trickle(sent)
    with pytest.raises(KvmemError, match=r"cannot read .*/metrics: no complete answer "
                                         r"within 1 s$"):
        within(4, lambda: scrape(raw.url, timeout_s=1.0))


def test_both_commands_give_up_on_a_trickling_server(raw, quick, capsys, tmp_path):
    raw.default = raw.trickle(b"HTTP/1.1 200 OK\r\n\r\n")
    err = one_error(capsys, within(5, lambda: main(["vllm-check", "--stats", raw.url])))
    assert "no complete answer within 1 s" in err
    [row] = top_rows(capsys, tmp_path, raw.url)
    assert row == {"server": f"{raw.url}/metrics",
                   "error": f"cannot read {raw.url}/metrics: no complete answer within 1 s"}


# -- what the server says --------------------------------------------------------------------
@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-5", "1e300"])
def test_figures_no_tier_could_have_are_an_error(raw, capsys, tmp_path, value):
    raw.default = page(VLLM_PAGE + "# TYPE kvmem_offload_used_bytes gauge\n"
                       f'kvmem_offload_used_bytes{{tier="cpu",rank="0"}} {value}\n')
    err = one_error(capsys, main(["vllm-check", "--stats", raw.url]))
    assert "kvmem_offload_used_bytes of tier cpu is" in err and "not a count, size or time" in err
    [row] = top_rows(capsys, tmp_path, raw.url)
    assert "not a count, size or time" in row["error"]


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-1"])
def test_a_prefill_rate_that_is_not_one_is_not_measured(value):
    text = VLLM_PAGE.replace("} 1100.0", f"}} {value}")
    assert read_figures(text).prefill_rates == {"0": 900.0}


@pytest.mark.parametrize("sent", [b"SSH-2.0-OpenSSH_9.6\r\n", b"hello", b"\x16\x03\x01\x02\x00"])
def test_an_answer_that_is_not_http_is_one_line(raw, capsys, tmp_path, sent):
    raw.default = lambda conn, head: conn.sendall(sent)
    err = one_error(capsys, main(["vllm-check", "--stats", raw.url]))
    assert f"cannot read {raw.url}/metrics: " in err
    [row] = top_rows(capsys, tmp_path, raw.url)
    assert row["error"].startswith(f"cannot read {raw.url}/metrics: ")


def test_markup_and_escape_sequences_from_a_server_are_shown_as_text(raw, capsys, tmp_path):
    raw.paths["/gone"] = reply("404 [bold]gone[/x] \x1b[2J")
    err = one_error(capsys, main(["vllm-check", "--stats", f"{raw.url}/gone"]))
    assert err == f"kvmem: error: cannot read {raw.url}/gone: 404 [bold]gone[/x] \\x1b[2J\n"
    labels = VLLM_PAGE.replace('tier="cpu"', 'tier="[/x]\x1b[31m"')
    raw.paths["/labels"] = page(labels.replace('rank="1"', 'rank="[bold]1"'))
    assert main(["vllm-check", "--stats", f"{raw.url}/labels"]) == 0
    out = capsys.readouterr().out
    assert "[/x]\\x1b[31m tier (" in out and "[bold]1: 1100" in out and "\x1b" not in out
    argv = ["top", "--ledger-dir", str(tmp_path), "--metrics", f"{raw.url}/labels",
            "--metrics", f"{raw.url}/gone"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "[/x]\\x1b[31m" in out and "[bold]gone[/x]" in out and "\x1b" not in out


def test_bytes_that_are_not_utf_8_are_replaced(raw, capsys):
    raw.default = reply("200 OK", VLLM_PAGE.encode().replace(b'tier="cpu"', b'tier="c\xffu"'),
                        Content_Type=TEXT)
    assert main(["vllm-check", "--stats", raw.url]) == 0
    assert "c\ufffdu tier (" in capsys.readouterr().out


@pytest.mark.parametrize(("headers", "message"), [
    ({"Content_Type": "text/html; charset=utf-8"}, "the answer is text/html, not a metrics page"),
    ({"Content_Type": TEXT, "Content_Encoding": "gzip"},
     "the page is gzip-encoded, though asked for plain text"),
])
def test_an_answer_that_is_not_a_metrics_page_is_named(raw, capsys, headers, message):
    raw.default = reply("200 OK", gzip.compress(b"<html>login</html>"), **headers)
    err = one_error(capsys, main(["vllm-check", "--stats", raw.url]))
    assert err == f"kvmem: error: cannot read {raw.url}/metrics: {message}\n"


def test_an_endless_page_is_read_only_up_to_the_bound(raw, monkeypatch):
    def endless(conn, head):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        while True:
            conn.sendall(b"# " + b"x" * 65534)

    raw.default = endless
    monkeypatch.setattr(scraping, "MAX_PAGE_BYTES", 1 << 20)
    with pytest.raises(KvmemError, match="the page is larger than 1.00 MiB"):
        within(10, lambda: scrape(raw.url, timeout_s=5.0))


def test_only_kvmem_lines_are_parsed_and_those_are_bounded(monkeypatch):
    broken = "vllm:broken{\n# TYPE x gauge\nx{a=\"\n" + VLLM_PAGE
    assert read_figures(broken).tiers["cpu"].get("hits") == 10  # others' lines cost nothing
    monkeypatch.setattr(verdict, "MAX_LINES", 10)
    with pytest.raises(KvmemError, match="more than 10 kvmem_ lines"):
        read_figures(VLLM_PAGE)
    many = "".join(f'kvmem_offload_hits_total{{tier="t{i}"}} 1\n' for i in range(65))
    monkeypatch.setattr(verdict, "MAX_LINES", 20_000)
    with pytest.raises(KvmemError, match="more than 64 tiers"):
        read_figures(many)


def test_a_page_that_does_not_parse_is_one_line(raw, capsys):
    raw.default = page("kvmem_offload_hits_total{tier=\"cpu\" 5\n")
    err = one_error(capsys, main(["vllm-check", "--stats", raw.url]))
    assert err.startswith(f"kvmem: error: {raw.url}/metrics: not a Prometheus metrics page (")


# -- redirects ---------------------------------------------------------------------------------
def test_a_redirect_is_followed_and_bounded(raw, capsys):
    raw.paths["/metrics"] = reply("307 Temporary Redirect", Location="/metrics/")
    raw.paths["/metrics/"] = page()
    assert main(["vllm-check", "--stats", raw.url]) == 0
    assert "cpu tier (" in capsys.readouterr().out
    raw.paths["/loop"] = reply("302 Found", Location="/loop")
    err = one_error(capsys, main(["vllm-check", "--stats", f"{raw.url}/loop"]))
    assert err == f"kvmem: error: cannot read {raw.url}/loop: more than 5 redirects\n"


@pytest.mark.parametrize("location", ["ftp://127.0.0.1/metrics", "file:///etc/passwd",
                                      "http://[::1", "http://host:99999/"])
def test_a_redirect_that_cannot_be_followed_is_one_line(raw, capsys, location):
    raw.default = reply("302 Found", Location=location)
    err = one_error(capsys, main(["vllm-check", "--stats", raw.url]))
    assert err.startswith(f"kvmem: error: cannot read {raw.url}/metrics: it redirects to "
                          f"{location}, which is not followed (")


# -- URLs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("url", "message"), [
    ("http://[::1", "not a usable URL: 'http://[::1' (Invalid IPv6 URL)"),
    ("http://host:abc/", "not a usable URL: 'http://host:abc/' (Port could not be cast"),
    ("http://host:99999/", "not a usable URL: 'http://host:99999/' (Port out of range"),
    ("http://:80/", "not an http(s) URL: 'http://:80/'"),
    ("http://127.0.0.1:9/a b", "not a usable URL: 'http://127.0.0.1:9/a b' (spaces and"),
    ("http://b\u00fccher.example/", "(write the host name in ASCII)"),
    ("file:///etc/passwd", "not an http(s) URL: 'file:///etc/passwd'"),
])
def test_a_url_that_cannot_be_used_is_one_line(capsys, url, message):
    err = one_error(capsys, main(["vllm-check", "--stats", url]))
    assert err.startswith("kvmem: error: ") and message in err
    with pytest.raises(SystemExit) as exit_:
        main(["top", "--metrics", url])
    err = one_error(capsys, exit_.value.code)
    assert err.startswith("kvmem: error: argument --metrics: ") and message in err


def test_a_megabyte_url_is_named_in_a_short_line(capsys):
    err = one_error(capsys, main(["vllm-check", "--stats", "http://x/" + "a" * (1 << 20) + " b"]))
    assert len(err) < 400 and err.endswith("... (spaces and control characters must be "
                                           "percent-encoded)\n")


@pytest.mark.parametrize("answer", [
    lambda conn, head: conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n" * 1_000_000),
    lambda conn, head: conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 200 + b"\r\n"),
    lambda conn, head: conn.sendall(b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70_000 + b"\r\n\r\n"),
    lambda conn, head: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 99\r\n\r\nkvmem_"),
    lambda conn, head: None,
], ids=["endless 100 Continue", "200 headers", "a 70 KB header", "cut short", "closed"])
def test_a_broken_answer_is_one_line(raw, capsys, answer):
    raw.default = answer
    err = one_error(capsys, within(10, lambda: main(["vllm-check", "--stats", raw.url])))
    assert err.startswith(f"kvmem: error: cannot read {raw.url}/metrics: ")


def test_other_than_ascii_in_a_path_is_percent_encoded(raw, capsys):
    raw.paths["/m%C3%A9trics"] = page()
    assert main(["vllm-check", "--stats", f"{raw.url}/m\u00e9trics"]) == 0
    assert raw.requests == ["/m%C3%A9trics"]

