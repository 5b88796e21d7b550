"""``kvmem plan --from-vllm-log`` on hostile input: garbled figures, markup in names, a
closed standard input, lines of megabytes, two engines' logs in one file, a closed pipe
and an ASCII-only terminal. Each ends in a report or one error line (exit 2), never a
traceback or a hang."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmem.cli import main
from kvmem.plan import vllm_log
from kvmem.plan.vllm_log import parse_vllm_engines, parse_vllm_log

DATA = Path(__file__).parent / "data" / "vllm_logs"
GEMMA = str(DATA / "tiny-gemma3")
LLAMA = (DATA / "gpu-0.10.1.1-llama-3.1-8b.log").read_text()
GEMMA_0_11 = (DATA / "gpu-0.11.0-gemma-3-27b-tp2.log").read_text()
ROOT = Path(__file__).parent.parent


def _run(capsys, tmp_path: Path, text: str, *extra: str) -> tuple[int, str, str]:
    path = tmp_path / "vllm.log"
    path.write_text(text, encoding="utf-8", errors="surrogateescape")
    code = main(["plan", "--from-vllm-log", str(path), *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error(code: int, err: str) -> None:
    assert code == 2 and err.startswith("kvmem: error: ") and err.count("\n") == 1, err


# ---------------------------------------------------------------------- garbled figures
@pytest.mark.parametrize(("old", "new", "unreadable"), [
    ("51.38 GiB", "1.2.3 GiB", "KV cache memory"),
    ("51.38 GiB", "1e999 GiB", "KV cache memory"),
    ("420,896 tokens", ", tokens", "KV cache size"),
    ("420,896 tokens", "9" * 5000 + " tokens", "KV cache size"),
    ("per request: 51.38x", "per request: 1.2.3x", "maximum concurrency"),
    ("max_num_batched_tokens=8192", "max_num_batched_tokens=" + "9" * 5000,
     "max_num_batched_tokens"),
])
def test_a_garbled_figure_is_a_line_it_cannot_read(capsys, tmp_path, old, new, unreadable):
    code, out, _ = _run(capsys, tmp_path, LLAMA.replace(old, new), "--json")
    assert code == 0
    assert any(f"a {unreadable} line kvmem cannot read" in n
               for n in json.loads(out)["notes"])


@pytest.mark.parametrize("args", [
    "'block_size': 'x'", "'block_size': 1e999", "'block_size': 0", "'block_size': True",
    "'max_num_seqs': -3", "'tensor_parallel_size': 100000", "'max_num_seqs': 2.5",
])
def test_a_setting_that_is_no_whole_number_is_one_error(capsys, tmp_path, args):
    text = LLAMA.replace("'max_model_len': 8192}", f"'max_model_len': 8192, {args}}}")
    code, _, err = _run(capsys, tmp_path, text)
    _one_error(code, err)
    assert "kvmem reads a whole number" in err


def test_markup_in_the_logged_model_name_is_printed_as_it_is(capsys, tmp_path):
    text = LLAMA.replace("model='meta-llama/Llama-3.1-8B-Instruct'", "model='[/x][bold]m'")
    code, out, _ = _run(capsys, tmp_path, text, "meta-llama/Llama-3.1-8B-Instruct")
    assert code == 0 and "log: [/x][bold]m, tp 1" in out


def test_a_closed_standard_input_is_one_error(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)  # what Python makes of a closed fd 0 (<&-)
    _one_error(main(["plan", "--from-vllm-log", "-"]), capsys.readouterr().err)


def test_a_closed_standard_input_from_the_shell(tmp_path):
    run = subprocess.run(["bash", "-c", f"{sys.executable} -m kvmem plan --from-vllm-log - <&-"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    _one_error(run.returncode, run.stderr)
    assert "standard input is closed" in run.stderr


# Lines of real logs, mutated: every line of every captured log is a seed.
SEEDS = [(path.name, line) for path in sorted(DATA.glob("*.log"))
         for line in path.read_text().splitlines()]
_NOISE = st.sampled_from(["", ",", ".", "1.2.3", "1e999", "-", "[/x]", "'", "{", "}", "(",
                          "9" * 400, " tokens", " GiB", "x", "None", ": ", "=", "\u00e9"])


@st.composite
def _mutated_log(draw) -> tuple[str, str]:
    """A captured log with a few of its lines cut, spliced with noise, or swapped in."""
    name = draw(st.sampled_from(sorted({n for n, _ in SEEDS})))
    lines = (DATA / name).read_text().splitlines()
    marked = [i for i, line in enumerate(lines)
              if any(r.marker in line for r in vllm_log._READERS)]
    for _ in range(draw(st.integers(1, 4))):
        # mostly the lines kvmem reads: the others it skips whatever they say
        i = draw(st.sampled_from(marked) if draw(st.integers(0, 4)) else
                 st.integers(0, len(lines) - 1))
        line = lines[i]
        at = draw(st.integers(0, len(line)))
        kind = draw(st.sampled_from(["splice", "cut", "digits", "seed"]))
        if kind == "splice":
            line = line[:at] + draw(_NOISE) + line[at + draw(st.integers(0, 8)):]
        elif kind == "cut":
            line = line[:at]
        elif kind == "digits" and (numbers := list(re.finditer(r"[\d.,]+", line))):
            number = draw(st.sampled_from(numbers))  # a figure, garbled
            line = line[:number.start()] + draw(_NOISE) + line[number.end():]
        else:
            line = draw(st.sampled_from(SEEDS))[1]
        lines[i] = line
    return name, "\n".join(lines)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=_mutated_log(), as_json=st.booleans())
def test_mutated_real_logs_end_in_a_report_or_one_error(case, as_json, tmp_path_factory,
                                                         capsys):
    name, text = case
    path = tmp_path_factory.mktemp("log") / "vllm.log"
    path.write_text(text)
    model = [GEMMA] if name.startswith("cpu-") else []
    problem_1 = name.startswith("gpu-0.15")
    if problem_1:  # its model is in no catalog
        config = path.parent / "config.json"
        config.write_text(json.dumps({
            "num_hidden_layers": 56, "hidden_size": 8576, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 134, "vocab_size": 32000,
            "max_position_embeddings": 1_048_576, "torch_dtype": "bfloat16"}))
        model = [str(config)]
    code = main(["plan", "--from-vllm-log", str(path), *model, *(["--json"] * as_json)])
    out, err = capsys.readouterr()
    if code == 0 and as_json:
        json.loads(out)
    elif code != 0:
        _one_error(code, err)


_PIECES = st.sampled_from([r.marker for r in vllm_log._READERS] + [
    "non-default args: {", "'speculative_config': {", "SpeculativeConfig(", "model=", "'",
    "(Worker_PP1_TP0 pid=1) ", "1", "1,000", "2.5", "GiB", " tokens", "x", ")", "}", "\n",
    "Initializing a V1 LLM engine (v0.33.0) with config: ", "vLLM API server version 0.33.0"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.one_of(_PIECES, st.text(max_size=8)), max_size=40))
def test_any_arrangement_of_markers_and_figures_reads_or_is_one_config_error(pieces):
    from kvmem.errors import ConfigError

    try:
        for log in parse_vllm_engines("".join(pieces)):
            assert log.lines[0] <= log.lines[1]
    except ConfigError as exc:
        assert "\n" not in str(exc)


# ---------------------------------------------------------------------- long lines
LONG = 2 << 20  # 2 MiB
LONG_LINES = [
    "a" * LONG,  # `(\w+) KV cache size: ` searched: 10,000 characters 1.2 s, 20,000 5.2 s
    "a" * LONG + " KV cache size: x",
    "GPU KV cache size: " * (LONG // 19),
    "(" * LONG + " Available KV cache memory: 1.00 GiB",
    # each config key tried at each letter: 10,000 characters 3.4 s, 20,000 13.1 s
    "Initializing a V1 LLM engine (v0.33.0) with config: " + "a" * LONG,
    "Initializing a V1 LLM engine (v0.33.0) with config: " + "k='" * (LONG // 3),
    "Initializing a V1 LLM engine (v0.33.0) with config: "
    + "speculative_config=SpeculativeConfig(" * (LONG // 37),
    "non-default args: {" + "'k': {" * (LONG // 6),
    "non-default args: {'" + "\\'" * (LONG // 2),
    "Maximum concurrency for " + "1," * (LONG // 2),
    "max seq len (" * (LONG // 13) + " GiB KV cache is needed",
]


class _Counted:
    """A compiled pattern that records the span of text each call may scan."""

    def __init__(self, pattern: re.Pattern, spans: list[int]):
        self.pattern, self.spans = pattern, spans

    def match(self, text: str, pos: int = 0, endpos: int = sys.maxsize):
        self.spans.append(min(endpos, len(text)) - pos)
        return self.pattern.match(text, pos, endpos)

    def search(self, text: str, pos: int = 0, endpos: int = sys.maxsize):
        self.spans.append(min(endpos, len(text)) - pos)
        return self.pattern.search(text, pos, endpos)


def test_each_pattern_is_tried_once_per_line_in_a_bounded_window(monkeypatch):
    """The work bound itself: on each long line every reader's pattern is tried at most
    once, and only the engine config and args readers (anchored at their marker, no
    backtracking past it) see more than a small window."""
    from dataclasses import replace

    spans: dict[str, list[int]] = {}
    readers = tuple(replace(r, pattern=_Counted(r.pattern, spans.setdefault(r.marker, [])))
                    for r in vllm_log._READERS)
    monkeypatch.setattr(vllm_log, "_READERS", readers)
    for line in LONG_LINES:
        for s in spans.values():
            s.clear()
        vllm_log._read_line(vllm_log.VllmLog(), 1, line)
        for reader in readers:
            calls = spans[reader.marker]
            assert len(calls) <= 1
            if calls and not reader.to_end:
                assert calls[0] <= reader.reach + len(reader.marker) + vllm_log._WINDOW


@pytest.mark.parametrize("line", LONG_LINES, ids=range(len(LONG_LINES)))
def test_a_line_of_megabytes_is_read_in_linear_time(line):
    """The first and the fifth took time growing with the square of their length when
    patterns were searched and keys tried at each letter (2 MiB: hours); read in linear
    time, each takes well under a second."""
    start = time.perf_counter()
    try:
        parse_vllm_log(line + "\nINFO GPU KV cache size: 16 tokens\n")
    except Exception as exc:  # noqa: BLE001 (only the time is tested here)
        assert type(exc).__name__ == "ConfigError"
    assert time.perf_counter() - start < 5


# ---------------------------------------------------------------------- two engines
def test_two_engines_logs_are_reported_each_on_its_own(capsys, tmp_path):
    code, out, _ = _run(capsys, tmp_path, LLAMA + GEMMA_0_11, "--json")
    assert code == 0
    engines = json.loads(out)["engines"]
    assert [e["release"] for e in engines] == ["vLLM 0.10.1.1", "vLLM 0.11.0"]
    assert [e["lines"] for e in engines] == [[1, 8], [9, 18]]
    assert engines[0]["deployment"].startswith("meta-llama/Llama-3.1-8B-Instruct, tp 1")
    assert engines[1]["deployment"].startswith("google/gemma-3-27b-it, tp 2")
    assert all(e["matches"] for e in engines), [e["rows"] for e in engines]
    # each engine's figures are its own: one size row for Llama, two (per worker) for Gemma
    assert [len([r for r in e["rows"] if r["what"].startswith("KV cache size")])
            for e in engines] == [1, 2]
    code, out, _ = _run(capsys, tmp_path, LLAMA + GEMMA_0_11)
    assert "engine 1 of 2 (log lines 1-8):" in out and "engine 2 of 2 (log lines 9-18):" in out


def test_the_same_engine_started_twice_is_two_engines():
    engines = parse_vllm_engines(LLAMA + LLAMA)
    assert [e.lines for e in engines] == [(1, 8), (9, 16)]
    assert [len(e.workers) for e in engines] == [1, 1]


def test_data_parallel_engine_cores_logging_one_config_are_one_engine():
    config = next(line for line in GEMMA_0_11.splitlines() if "Initializing a V1" in line)
    text = GEMMA_0_11.replace(config, config + "\n" + config.replace("DP0", "DP1"))
    assert len(parse_vllm_engines(text)) == 1


def test_an_engine_of_two_that_cannot_be_compared_is_named_and_the_other_reported(
        capsys, tmp_path):
    problem_1 = (DATA / "gpu-0.15.1-problem-1-tp8-pp2.log").read_text()  # no catalog model
    code, out, err = _run(capsys, tmp_path, LLAMA + problem_1)
    _one_error(code, err)
    assert "the engine at log lines 9-13: the log's model '/models/problem-1'" in err
    assert "engine 1 of 2" in out and "vLLM 0.10.1.1 log: meta-llama" in out


def test_a_log_of_more_engine_starts_than_kvmem_compares_is_one_error(capsys, tmp_path):
    code, _, err = _run(capsys, tmp_path, LLAMA * 65)
    _one_error(code, err)
    assert "holds 65 engine starts (at lines 1, 9, 17, ...); kvmem compares at most 64" in err


# ---------------------------------------------------------------------- output
def _shell(command: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, **env})


@pytest.mark.parametrize(("flag", "first"), [
    ("--json", "{"), ("", "engine 1 of 60 (log lines 1-8):")])
def test_a_reader_that_closes_the_pipe_ends_it_quietly(tmp_path, flag, first):
    """60 engines' reports are more than a pipe holds (over 130 kB), so the writer meets
    the closed pipe whenever the reader leaves."""
    path = tmp_path / "many.log"
    path.write_text(LLAMA * 60)
    run = _shell(f"{sys.executable} -m kvmem plan --from-vllm-log {path} {flag} | head -1;"
                 " exit ${PIPESTATUS[0]}")
    assert run.stdout == first + "\n" and run.stderr == ""
    assert run.returncode == 141  # as a command ended by SIGPIPE


def test_an_ascii_only_terminal_gets_the_report_with_characters_replaced(tmp_path):
    path = tmp_path / "vllm.log"
    path.write_text(LLAMA.replace("model='meta-llama/Llama-3.1-8B-Instruct'",
                                  "model='mod\u00e8le-\u00e9'"), encoding="utf-8")
    # the C locale without the UTF-8 mode Python turns on for it by default
    c_locale = {"LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}
    for env in ({"PYTHONIOENCODING": "ascii"}, c_locale):
        run = _shell(f"{sys.executable} -m kvmem plan --from-vllm-log {path} "
                     "meta-llama/Llama-3.1-8B-Instruct", **env)
        assert run.returncode == 0, run.stderr
        assert "log: mod?le-?, tp 1" in run.stdout
