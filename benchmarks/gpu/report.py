"""A GPU check's report: named checks and figures, written as DIR/<name>.json and .md.

Every check runs inside ``report.check(title)``: a failure is recorded with the end of
its traceback and the script goes on to the next check, so one broken path never hides
the others' results.
"""

from __future__ import annotations

import json
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU ({platform.processor() or platform.machine()})"


class Report:
    def __init__(self, name: str, out: Path, device: str) -> None:
        self.name, self.out = name, Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.data: dict[str, Any] = {"name": name, "device": device_name(device),
                                     "checks": {}, "figures": {}}
        self.lines: list[str] = []
        self.started = time.perf_counter()

    @contextmanager
    def check(self, title: str):
        """Record ``title`` as passed unless the block raises (then failed, with why)."""
        start = time.perf_counter()
        print(f"[{self.name}] {title} ...", flush=True)
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - a failed check is a result, not an abort
            tail = "".join(traceback.format_exception(exc)).strip().splitlines()[-12:]
            self.data["checks"][title] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                          "traceback": tail,
                                          "seconds": round(time.perf_counter() - start, 2)}
            print(f"[{self.name}] FAILED {title}: {type(exc).__name__}: {exc}", flush=True)
            print("\n".join(tail), flush=True)
        else:
            self.data["checks"][title] = {"ok": True,
                                          "seconds": round(time.perf_counter() - start, 2)}
            print(f"[{self.name}] ok {title}", flush=True)
        finally:
            self.save()

    def figure(self, key: str, value: Any) -> None:
        self.data["figures"][key] = value
        print(f"[{self.name}] {key} = {value}", flush=True)
        self.save()

    def line(self, text: str = "") -> None:
        self.lines.append(text)
        self.save()

    def save(self) -> None:
        self.data["seconds"] = round(time.perf_counter() - self.started, 1)
        (self.out / f"{self.name}.json").write_text(json.dumps(self.data, indent=1))
        checks = "\n".join(f"- {'PASS' if c['ok'] else 'FAIL'} {t}"
                           + ("" if c["ok"] else f": {c['error']}")
                           for t, c in self.data["checks"].items())
        (self.out / f"{self.name}.md").write_text(
            f"## {self.name} on {self.data['device']}\n\n{checks}\n\n"
            + "\n".join(self.lines) + "\n")

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.data["checks"].values())
