"""``kvmem limit NAME SIZE``: change a running engine's elastic KV memory limit.

``--total SIZE`` changes the limit all engines on a device share; ``none`` removes a limit.
The engine picks the new limit up at its next heartbeat and gives back free pages above it.
"""

from __future__ import annotations

import argparse

from kvmem.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="engine name (as shown by kvmem top)")
    p.add_argument("size", nargs="?", help="new limit, e.g. 4GiB, 512MiB, or none")
    p.add_argument("--total", metavar="SIZE", default=None,
                   help="set the limit shared by all engines on --device instead")
    p.add_argument("--device", default=None, help="device of the ledger (default: every ledger)")
    p.add_argument("--ledger-dir", default=None,
                   help="where the ledgers live (default $KVMEM_LEDGER_DIR or /dev/shm)")


def check_device(name: str, ledger_dir: str | None) -> str:
    """``name`` as engines name their device in the ledger (``cpu``, ``cuda:N``); refused
    unless this machine has that device or an engine has used it (its ledger exists)."""
    from kvmem.memory.ledger import Ledger

    kind, _, index = name.strip().lower().partition(":")
    if kind == "cpu" and not index:
        return "cpu"
    if kind != "cuda" or (index and not index.isdecimal()):
        raise ConfigError(f"--device must be cpu or cuda:N (as kvmem top shows it), got {name!r}")
    device = f"cuda:{int(index or 0)}"
    if Ledger.for_device(device, ledger_dir).path.exists():
        return device
    import torch

    count = torch.cuda.device_count()
    if int(index or 0) >= count:
        raise ConfigError(f"--device {name}: this machine has {count} CUDA device"
                          f"{'' if count == 1 else 's'}")
    return device


def _size(text: str, what: str) -> int | None:
    from kvmem.units import parse_size

    return None if text.strip().lower() in ("none", "unlimited") else parse_size(text, what)


def run(args: argparse.Namespace) -> int:
    from kvmem.memory.ledger import Ledger, UnknownEngineError
    from kvmem.units import format_bytes

    device = check_device(args.device, args.ledger_dir) if args.device is not None else None
    if args.total is not None:
        if args.name is not None:
            raise ConfigError("give either NAME SIZE or --total SIZE, not both")
        if device is None:
            raise ConfigError("--total needs --device (e.g. --device cuda:0)")
        nbytes = _size(args.total, "--total")
        Ledger.for_device(device, args.ledger_dir).set_total_limit(nbytes)
        print(f"{device}: shared limit {format_bytes(nbytes) if nbytes else 'removed'}")
        return 0
    if args.name is None or args.size is None:
        raise ConfigError("usage: kvmem limit NAME SIZE (or --total SIZE --device DEVICE)")
    nbytes = _size(args.size, "SIZE")
    ledgers = Ledger.all(args.ledger_dir)  # an engine's limit: only ledgers that exist
    if device is not None:
        path = Ledger.for_device(device, args.ledger_dir).path
        ledgers = [ledger for ledger in ledgers if ledger.path == path]
    changed = []
    for ledger in ledgers:
        try:
            ledger.set_limit(args.name, nbytes)
            changed.append(ledger.device)
        except UnknownEngineError:
            continue
    if not changed:
        raise UnknownEngineError(f"no running engine named {args.name!r} (see kvmem top)")
    shown = format_bytes(nbytes) if nbytes else "none"
    print(f"{args.name}: limit {shown} on {', '.join(changed)}")
    return 0
