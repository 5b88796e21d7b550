"""``kvmem vllm-check --stats URL`` and ``kvmem top --metrics URL``: the tiers' figures read
from a /metrics page (kvmem serve's, or vLLM's with KvmemConnector: per rank), summed and
judged (``kvmem.tiers.verdict``). The live vLLM page is checked in tests/test_vllm_stats.py."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from prometheus_client import generate_latest
from test_offload_cli import snapshot

from kvmem.cli import main
from kvmem.serve.metrics import make_registry
from kvmem.tiers import TierStats
from kvmem.tiers.verdict import read_figures, verdict_lines
from kvmem.units import GiB

CPU = TierStats(lookups=40, hits=30, misses=10, hit_tokens=3840, prefill_saved_seconds=6.0,
                stored_blocks=50, bytes_stored=50 << 20, store_seconds=0.5, loaded_blocks=30,
                bytes_loaded=3_000_000_000, load_seconds=1.5, failed_loads=2,
                failed_load_causes={"missing": 2}, evictions=20, wasted_blocks=10,
                unused_blocks=5, used_bytes=GiB // 2, capacity_bytes=2 * GiB)
DISK = TierStats(lookups=10, hits=0, misses=10, stored_blocks=50, used_bytes=1 << 20,
                 capacity_bytes=8 * GiB)

# what vLLM's /metrics shows for KvmemConnector at tp 2: one series per rank
VLLM_PAGE = """\
# HELP kvmem_offload_hits_total KV blocks a prefix lookup found in this tier
# TYPE kvmem_offload_hits_total counter
kvmem_offload_hits_total{engine="0",model_name="m",rank="0",tier="cpu"} 5.0
kvmem_offload_hits_total{engine="0",model_name="m",rank="1",tier="cpu"} 5.0
# HELP kvmem_offload_lookups_total KV blocks looked up in this tier (hits + misses)
# TYPE kvmem_offload_lookups_total counter
kvmem_offload_lookups_total{engine="0",model_name="m",rank="0",tier="cpu"} 10.0
kvmem_offload_lookups_total{engine="0",model_name="m",rank="1",tier="cpu"} 10.0
# HELP kvmem_offload_failed_loads_total KV blocks that could not be loaded, by cause
# TYPE kvmem_offload_failed_loads_total counter
kvmem_offload_failed_loads_total{cause="checksum",engine="0",model_name="m",rank="1",tier="cpu"} 1.0
# HELP kvmem_prefill_tokens_per_second The engine's measured prefill rate
# TYPE kvmem_prefill_tokens_per_second gauge
kvmem_prefill_tokens_per_second{engine="0",model_name="m",rank="0"} 900.0
kvmem_prefill_tokens_per_second{engine="0",model_name="m",rank="1"} 1100.0
"""


def kvmem_page() -> str:
    return generate_latest(make_registry(lambda: snapshot(640.0, cpu=CPU, disk=DISK),
                                         "m")).decode()


def test_figures_of_kvmem_serve_are_read_back_and_judged():
    figures = read_figures(kvmem_page())
    cpu, disk = figures.tiers["cpu"], figures.tiers["disk"]
    assert figures.prefill_rates == {"engine": 640.0}
    assert cpu.hit_rate == 0.75 and cpu.load_gb_per_s == 2.0
    assert cpu.saved_s_per_gib == 3.0  # 6 s saved by a 2 GiB tier
    assert cpu.wasted_share == 0.2 and cpu.wasted_share_at_most == 0.3
    assert cpu.payback == 4.0 and cpu.failed_load_causes["missing"] == 2
    text = "\n".join(verdict_lines(cpu))
    for part in ("hit rate 75.0% (30 of 40 blocks looked up)", "loads 2.00 GB/s",
                 "3.000 s per GiB of tier memory", "stores never loaded 20.0% of 50 (up to "
                 "30.0%", "failed loads: 2 missing", "pays: its loads saved 4.0x"):
        assert part in text, part
    assert "no hits yet" in verdict_lines(disk)[-1]


def test_vllm_figures_are_summed_over_ranks():
    figures = read_figures(VLLM_PAGE)
    cpu = figures.tiers["cpu"]
    assert cpu.get("hits") == 10 and cpu.get("lookups") == 20 and cpu.hit_rate == 0.5
    assert cpu.failed_load_causes == {"checksum": 1.0} and cpu.get("failed_loads") == 1
    assert figures.prefill_rates == {"0": 900.0, "1": 1100.0}


@pytest.fixture
def server():
    """A /metrics page served over HTTP; ``pages[path]`` is what it serves."""
    pages: dict[str, str] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = pages.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write((body or "").encode())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield pages, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_vllm_check_stats_reads_a_server(server, capsys):
    pages, base = server
    pages["/metrics"] = kvmem_page()
    assert main(["vllm-check", "--stats", base]) == 0  # /metrics added to a bare server
    out = capsys.readouterr().out
    assert out.startswith(f"{base}/metrics: measured prefill rate (tokens/s) engine: 640")
    assert "cpu tier (512.00 MiB of 2.00 GiB used)" in out and "disk tier" in out
    assert main(["vllm-check", "--stats", f"{base}/metrics", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {t["tier"]: t["hit_rate"] for t in report["tiers"]} == {"cpu": 0.75, "disk": 0.0}


@pytest.mark.parametrize(("url", "message"), [
    ("ftp://x/metrics", "not an http(s) URL: 'ftp://x/metrics'"),
    ("{base}/nothing", "cannot read {base}/nothing: 404 Not Found"),
    ("{base}/plain", "{base}/plain shows no kvmem_offload_* figures"),
])
def test_vllm_check_stats_errors_are_one_line(server, capsys, url, message):
    pages, base = server
    pages["/plain"] = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    assert main(["vllm-check", "--stats", url.format(base=base)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvmem: error: {message.format(base=base)}") and err.count("\n") == 1


def test_top_shows_the_tiers_of_each_server(server, capsys, tmp_path):
    pages, base = server
    pages["/metrics"] = kvmem_page()
    pages["/vllm"] = VLLM_PAGE
    argv = ["top", "--ledger-dir", str(tmp_path), "--metrics", base, "--metrics",
            f"{base}/vllm", "--metrics", f"{base}/gone"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["version"] == 1 and report["devices"] == []
    assert [(r["server"], r.get("tier"), r.get("hit_rate")) for r in report["tiers"]] == [
        (f"{base}/metrics", "cpu", 0.75), (f"{base}/metrics", "disk", 0.0),
        (f"{base}/vllm", "cpu", 0.5), (f"{base}/gone", None, None)]
    assert report["tiers"][-1]["error"].startswith(f"cannot read {base}/gone")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kvmem offload tiers" in out and "75%" in out and "2.00" in out
    with pytest.raises(SystemExit) as exit_:
        main(["top", "--metrics", "nonsense"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("kvmem: error: argument --metrics: not an http(s) "
                                       "URL: 'nonsense'\n")
