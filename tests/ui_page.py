"""The `kvmem ui` server and a headless Chromium for the page's tests.

The browser is the system's Chromium (``apt-get install chromium``; ``KVMEM_CHROMIUM``
names another binary) driven by Playwright, never a browser Playwright downloads. Without
either the browser tests are skipped, except under ``KVMEM_REQUIRE_BROWSER=1`` (CI), where
they fail.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmem.cli import main
from kvmem.ui.server import UIServer

README_EXAMPLE = ["Qwen/Qwen3-32B", "--pp", "2", "--layer-partition", "56,8",
                  "--kv-cache-dtype", "fp8", "--kv-cache-memory-bytes", "5GiB",
                  "--max-model-len", "40960", "--kv-budget", "proportional"]
README_QUERY = ("model=Qwen%2FQwen3-32B&pp=2&layer_partition=56%2C8&kv_cache_dtype=fp8"
                "&kv_cache_memory_bytes=5GiB&max_model_len=40960&kv_budget=proportional")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
SCREENSHOTS = Path(__file__).resolve().parent.parent / "ui-screenshots"  # gitignored


@contextlib.contextmanager
def serving(**options) -> Iterator[UIServer]:
    """A `kvmem ui` server on a free loopback port, in a thread of this process (``options``:
    UIServer's)."""
    server = UIServer("127.0.0.1", 0, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def cli(argv: list[str]) -> tuple[int, str, str]:
    """`kvmem ARGV` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as done:  # argparse's own errors
            code = done.code
    return code, out.getvalue(), err.getvalue()


def cli_error(argv: list[str]) -> str:
    """The one-line error `kvmem plan ARGV` prints, without its ``kvmem: error: ``."""
    code, _, err = cli(["plan", *argv])
    assert code == 2, err
    line = err.strip()
    assert line.startswith("kvmem: error: ") and "\n" not in line, line
    return line.removeprefix("kvmem: error: ")


def _unavailable(message: str):
    if os.environ.get("KVMEM_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{message}; KVMEM_REQUIRE_BROWSER=1 requires it", pytrace=False)
    pytest.skip(message)


def chromium() -> str:
    """The system's Chromium; skips (fails under KVMEM_REQUIRE_BROWSER=1) without it."""
    path = os.environ.get("KVMEM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(path, os.X_OK):
        _unavailable(f"no Chromium at {path} (apt-get install chromium, or set "
                     "KVMEM_CHROMIUM)")
    return path


@contextlib.contextmanager
def browser_context(**options) -> Iterator:
    """A headless Chromium with a fresh profile, as one Playwright browser context."""
    path = chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed (pip install 'kvmem[test]')")
    with tempfile.TemporaryDirectory(prefix="kvmem-ui-chromium-") as profile, \
            sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=path, args=CHROMIUM_ARGS, headless=True, **options)
        try:
            yield context
        finally:
            context.close()


def expect(target):
    """Playwright's retrying assertions (imported once the browser fixture has found it)."""
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)
