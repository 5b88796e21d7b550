"""``kvmem generate`` / ``kvmem chat`` / ``kvmem serve`` as a user runs them: output, and
one-line errors with exit code 2 for bad input."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli"), "llama")


def kvmem(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvmem", *args], input=stdin, env=env,
                          capture_output=True, text=True, timeout=120)


def test_one_cpu_thread_here_and_in_subprocesses():
    import torch

    assert os.environ["OMP_NUM_THREADS"] == "1" and torch.get_num_threads() == 1
    code = "import os; print(os.environ['OMP_NUM_THREADS'])"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, check=True)  # the inherited environment, no env=
    assert child.stdout.split() == ["1"]


ENGINE_FLAGS = ["--max-model-len", "64", "--kv-cache-memory-bytes", "1MiB"]


def test_generate_prints_the_completion(model_dir):
    from kvmem.engine.llm import LLM
    from kvmem.engine.sampling_params import SamplingParams

    res = kvmem("generate", "Hello", "--model", str(model_dir), "--max-tokens", "6",
                "--ignore-eos", *ENGINE_FLAGS)
    assert res.returncode == 0, res.stderr
    llm = LLM(str(model_dir), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    expected = llm.generate("Hello", SamplingParams(max_tokens=6, temperature=0,
                                                    ignore_eos=True))[0].text
    assert res.stdout == expected + "\n"


def test_chat_reads_turns_from_stdin(model_dir):
    res = kvmem("chat", str(model_dir), "--max-tokens", "3", *ENGINE_FLAGS,
                stdin="hi\n\n/reset\nhello again\n/exit\n")
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2  # one reply line per turn


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "x", "--model", "/no/such/model"], "not found"),
    (["generate", "x", "--temperature", "-2"], "temperature"),
    # the flags as typed, never EngineConfig's field names
    (["generate", "x", "--max-num-seqs", "0"], "--max-num-seqs must be a positive integer"),
    (["generate", "x", "--kv-memory-limit", "1GiB"], "--kv-memory-limit needs --kv-memory elastic"),
    (["serve", "--cpu-kv-memory", "0"], "--cpu-kv-memory must be positive, got '0'"),
    (["serve", "--distributed-timeout", "0"], "--distributed-timeout must be positive"),
    # below a second every body would be answered 408 (1e-300 used to be accepted)
    (["serve", "--request-body-timeout", "1e-300"], "from 1 to 86400 seconds, got 1e-300"),
    (["serve", "--request-body-timeout", "0.5"], "from 1 to 86400 seconds, got 0.5"),
    (["serve", "--request-head-timeout", "0"], "--request-head-timeout must be from 1 to 86400"),
    (["generate", "x", "--kv-cache-memory-bytes", "lots"], "cannot read 'lots'"),
    (["generate", "x", "--sample-seed", "99999999999999999999999"], "seed must be an integer in"),
    (["generate", "x", "--seed", "99999999999999999999999"], "seed must be an integer in"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    res = kvmem(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmem: error:") and message in lines[0]


def test_serve_on_a_busy_port_fails_fast(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = kvmem("serve", str(model_dir), "--port", str(port))
    assert res.returncode == 2
    assert res.stderr.strip().startswith("kvmem: error: cannot listen on 127.0.0.1:")


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_serve_writes_an_ipv6_address_in_brackets(tmp_path, capsys):
    """The URL printed for ``--port 0`` (before the model loads: an empty directory then
    fails) and a busy port's error put an IPv6 literal in brackets."""
    from kvmem.cli import main

    assert main(["serve", str(tmp_path), "--host", "::1", "--port", "0"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("kvmem: listening on http://[::1]:"), out
    int(out.strip().rsplit(":", 1)[1])  # the port follows the bracket
    with socket.socket(socket.AF_INET6) as busy:
        busy.bind(("::1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path), "--host", "::1", "--port", str(port)]) == 2
    assert capsys.readouterr().err.startswith(f"kvmem: error: cannot listen on [::1]:{port}:")


@pytest.fixture(scope="module")
def damaged_models(tmp_path_factory, model_dir):
    """GGUF files with the right magic and damage after it, and a checkpoint directory
    whose config.json is not UTF-8."""
    import shutil

    from tiny_models import embedded_files  # noqa: F401 (the embedded GGUF is installed)

    from kvmem.engine.loader.gguf_convert import embedded_gguf

    root = tmp_path_factory.mktemp("damaged")
    with embedded_gguf().open("rb") as f:
        head = f.read(1 << 16)
    (root / "truncated.gguf").write_bytes(head)  # metadata cut short
    (root / "garbage.gguf").write_bytes(head[:8] + bytes(range(256)) * 16)  # magic, version
    latin1 = root / "latin1"
    shutil.copytree(model_dir, latin1)
    (latin1 / "config.json").write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    return root


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("name", ["truncated.gguf", "garbage.gguf", "latin1"])
def test_a_damaged_model_is_one_line_naming_it_exit_2(damaged_models, tmp_path, monkeypatch,
                                                      capsys, command, name):
    """In-process (an uncaught exception would fail the test), so it costs no torch import."""
    from kvmem.cli import main

    path = damaged_models / name
    monkeypatch.setenv("KVMEM_CACHE_DIR", str(tmp_path))
    args = ["generate", "hi", "--model", str(path)] if command == "generate" else \
        ["serve", str(path), "--port", "0"]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmem: error:"), lines
    assert str(path) in lines[0]
    assert not list(tmp_path.glob("models/*"))  # no half-converted model left behind
