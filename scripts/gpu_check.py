"""Every GPU check of kvmem in one bounded run, with one report (markdown + JSON).

    scripts/gpu-check [OUT_DIR]            # all sections
    KVMEM_GPU_SECTIONS="tests speed" scripts/gpu-check OUT_DIR

Sections run one after another in processes of their own (each measures the device from
a clean start), each under its own time limit and all under one deadline
(``KVMEM_GPU_DEADLINE_S``, default 560 s): a section that would start too late is
skipped and says so. After every section OUT_DIR holds the whole report so far:
report.md, report.json, logs.tar.gz (each section's output) and cuda-tests.xml.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# (name, seconds allowed, argv); benchmark sections write WORK/<script>.{json,md}
SECTIONS: list[tuple[str, int, list[str]]] = [
    ("env", 20, [PY, "-c", "import sys, torch, triton, kvmem, fastapi; print(sys.version); "
                 "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', "
                 "triton.__version__); print(torch.cuda.get_device_name(), "
                 "torch.cuda.mem_get_info())"]),
    ("tests", 110, [PY, "-m", "pytest", "-m", "cuda", "-q", "-rA", "-p", "no:cacheprovider",
                    "--junitxml", "{work}/cuda-tests.xml", "{cuda_test_files}"]),
    ("correctness", 70, [PY, "benchmarks/gpu/triton_correctness.py", "--out", "{work}",
                         "--budget-s", "60"]),
    ("elastic", 70, [PY, "benchmarks/gpu/elastic_cuda.py", "--out", "{work}", "--budget-s", "65"]),
    ("tp", 50, [PY, "benchmarks/gpu/tp_elastic_cuda.py", "--out", "{work}", "--budget-s", "45"]),
    ("profile", 170, [PY, "benchmarks/gpu/profile_burst.py", "--out", "{work}",
                      "--budget-s", "150"]),
    ("speed", 260, [PY, "benchmarks/gpu/engine_speed.py", "--out", "{work}", "--budget-s", "240"]),
    ("tiers", 170, [PY, "benchmarks/gpu/tier_copies.py", "--out", "{work}", "--budget-s", "160"]),
    ("vllm", 170, [PY, "benchmarks/gpu/vllm_on_device.py", "--out", "{work}", "--budget-s", "150"]),
]


def cuda_test_files() -> list[str]:
    """The test modules that hold ``cuda``-marked tests (collecting only those keeps the
    run free of other modules' optional imports)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.cuda" in p.read_text())


def expand(argv: list[str], work: Path) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if arg == "{cuda_test_files}":
            out += cuda_test_files()
        else:
            out.append(arg.format(work=work))
    return out


def run_section(name: str, limit: float, argv: list[str], work: Path) -> dict:
    script = next((a for a in argv if a.endswith(".py")), None)
    if script and not (ROOT / script).is_file():
        return {"status": "absent", "seconds": 0, "note": f"{script} is not in this tree"}
    print(f"=== {name} (up to {limit:.0f} s)", flush=True)
    start = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)

        def copy() -> None:  # the section's output to its log and to ours, as it comes
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                log.flush()
                sys.stdout.write(line)
                sys.stdout.flush()

        reader = threading.Thread(target=copy, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=limit)
            status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
        except subprocess.TimeoutExpired:
            status = "timeout"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    seconds = round(time.perf_counter() - start, 1)
    print(f"=== {name}: {status} in {seconds} s", flush=True)
    return {"status": status, "seconds": seconds}


def junit_counts(path: Path) -> dict:
    """Tests, failures, errors and skips of a pytest JUnit file (a skip on a GPU machine is
    a test that did not run: the status says so)."""
    import xml.etree.ElementTree as ET

    try:
        suite = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    if counts["skipped"]:
        counts["status_note"] = f"{counts['skipped']} skipped"
    return counts


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def write_report(out: Path, work: Path, results: dict[str, dict], started: float) -> None:
    sections = {}
    md = ["# kvmem GPU check", "", f"Wall time so far: {time.perf_counter() - started:.0f} s",
          "", "| section | status | seconds |", "| --- | --- | --- |"]
    for name, r in results.items():
        note = r.get("status_note") or ""
        md.append(f"| {name} | {r['status']}{' (' + note + ')' if note else ''} "
                  f"| {r['seconds']} |")
    md.append("")
    for part in sorted(work.glob("*.json")):
        try:
            sections[part.stem] = json.loads(part.read_text())
        except ValueError:
            continue
    for part in sorted(work.glob("*.md")):
        md += [part.read_text(), ""]
    for name, r in results.items():
        if r["status"] != "ok" and r["status"] != "absent":
            md += [f"## {name}: {r['status']} (end of its output)", "", "```",
                   tail(work / f"{name}.log"), "```", ""]
    env_log = tail(work / "env.log", 10)
    (out / "report.md").write_text("\n".join(md))
    (out / "report.json").write_text(json.dumps(
        {"sections": results, "results": sections, "env": env_log}, indent=1))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for log in sorted(work.glob("*.log")):
            tar.add(log, arcname=log.name)
    (out / "logs.tar.gz").write_bytes(buf.getvalue())
    junit = work / "cuda-tests.xml"
    if junit.is_file():
        (out / "cuda-tests.xml").write_bytes(junit.read_bytes())


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "gpu-report"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("KVMEM_GPU_WORK", "/tmp/kvmem-gpu-work"))
    work.mkdir(parents=True, exist_ok=True)
    wanted = os.environ.get("KVMEM_GPU_SECTIONS", "").split()
    budget = float(os.environ.get("KVMEM_GPU_DEADLINE_S", "560"))
    started = time.perf_counter()
    results: dict[str, dict] = {}
    for name, limit, argv in SECTIONS:
        if wanted and name not in wanted:
            continue
        left = budget - (time.perf_counter() - started)
        if left < min(limit, 45):
            results[name] = {"status": "skipped (deadline)", "seconds": 0}
        else:
            results[name] = run_section(name, min(limit, left), expand(argv, work), work)
            if name == "tests":
                results[name].update(junit_counts(work / "cuda-tests.xml"))
        write_report(out, work, results, started)
    bad = [n for n, r in results.items() if r["status"] not in ("ok", "absent")]
    print(f"GPU check: {len(results) - len(bad)} of {len(results)} sections ok"
          + (f"; not ok: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
