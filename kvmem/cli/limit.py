"""``kvmem limit``: change a running engine's floor and ceiling, or a device's total.

    kvmem limit NAME 4GiB                   # its ceiling (as --max)
    kvmem limit NAME --min 2GiB --max 8GiB  # floor and ceiling
    kvmem limit --total 60GiB --device cuda:0

``none`` removes a ceiling or a total. A floor is reserved for its engine: others never
grow into it, so the floors together must fit the total. The engine applies a change at
its next heartbeat (within about 0.05 s): a lowered ceiling gives back free pages, then
cached blocks, then preempts running requests until it is under it.
"""

from __future__ import annotations

import argparse

from kvmem.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="engine name (as shown by kvmem top)")
    p.add_argument("size", nargs="?", help="new ceiling, e.g. 4GiB, 512MiB, or none")
    p.add_argument("--min", metavar="SIZE", default=None, dest="floor",
                   help="the engine's floor: reserved for it whatever the others do")
    p.add_argument("--max", metavar="SIZE", default=None, dest="ceiling",
                   help="the engine's ceiling: the most it may hold (none: no ceiling)")
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
    from kvmem.memory import control
    from kvmem.memory.ledger import check_engine_name
    from kvmem.units import format_bytes

    def shown(n: int | None) -> str:
        return "none" if n is None else format_bytes(n)

    device = check_device(args.device, args.ledger_dir) if args.device is not None else None
    if args.total is not None:
        if args.name is not None or args.floor is not None or args.ceiling is not None:
            raise ConfigError("give either NAME with a size, --min or --max, or --total SIZE, "
                              "not both")
        if device is None:
            raise ConfigError("--total needs --device (e.g. --device cuda:0)")
        nbytes = _size(args.total, "--total")
        control.set_total(device, nbytes, args.ledger_dir)
        print(f"{device}: shared limit {format_bytes(nbytes) if nbytes else 'removed'}")
        return 0
    if args.size is not None and args.ceiling is not None:
        raise ConfigError("give the ceiling once: SIZE or --max SIZE")
    ceiling_text = args.size if args.size is not None else args.ceiling
    if args.name is None or (ceiling_text is None and args.floor is None):
        raise ConfigError("usage: kvmem limit NAME SIZE, kvmem limit NAME [--min SIZE] "
                          "[--max SIZE], or kvmem limit --total SIZE --device DEVICE")
    check_engine_name(args.name)
    floor = None if args.floor is None else (_size(args.floor, "--min") or 0)
    ceiling = "keep" if ceiling_text is None else _size(ceiling_text, "--max")
    changed = control.set_limits(args.name, floor_bytes=floor, ceiling_bytes=ceiling,
                                 device=device, ledger_dir=args.ledger_dir)
    parts = ([] if floor is None else [f"floor {shown(floor)}"]) + \
        ([] if ceiling == "keep" else [f"limit {shown(ceiling)}"])  # type: ignore[arg-type]
    print(f"{args.name}: {', '.join(parts)} on {', '.join(changed)}")
    return 0
