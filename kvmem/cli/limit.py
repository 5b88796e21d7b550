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


def _size(text: str, what: str) -> int | None:
    from kvmem.units import parse_size

    return None if text.strip().lower() in ("none", "unlimited") else parse_size(text, what)


def run(args: argparse.Namespace) -> int:
    from kvmem.memory.ledger import Ledger, UnknownEngineError
    from kvmem.units import format_bytes

    if args.total is not None:
        if args.name is not None:
            raise ConfigError("give either NAME SIZE or --total SIZE, not both")
        if args.device is None:
            raise ConfigError("--total needs --device (e.g. --device cuda:0)")
        nbytes = _size(args.total, "--total")
        Ledger.for_device(args.device, args.ledger_dir).set_total_limit(nbytes)
        print(f"{args.device}: shared limit {format_bytes(nbytes) if nbytes else 'removed'}")
        return 0
    if args.name is None or args.size is None:
        raise ConfigError("usage: kvmem limit NAME SIZE (or --total SIZE --device DEVICE)")
    nbytes = _size(args.size, "SIZE")
    ledgers = ([Ledger.for_device(args.device, args.ledger_dir)] if args.device
               else Ledger.all(args.ledger_dir))
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
