"""How engines on one device share its KV memory: the rules over the ledger's table.

Each engine has a **floor** (reserved for it: no other engine grows into it, so it can
always take up to its floor) and a **ceiling** (the most it may hold); the device may
have a **total** for all engines. An engine holds ``mapped_bytes``; the total counts
each engine as ``max(mapped, floor)``, so

    sum over engines of max(mapped, floor) <= total

whenever every take goes through :func:`room`. When an engine is short under the total
and other engines hold memory above their floors that is not live KV (free pages, or
pages holding only cached prefix blocks), :func:`ask_reclaim` asks them to give it back,
the least recently active engine first; each gives back at its next look at the ledger
(``kvmem.memory.budget``). Live KV is never asked for: running requests are never
touched by another engine's reclaim.

Pure functions of the table; no I/O.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvmem.errors import ConfigError
from kvmem.memory.ledger_table import LedgerEntry, LedgerTable, UnknownEngineError
from kvmem.units import format_bytes

if TYPE_CHECKING:
    from kvmem.memory.ledger import Ledger


def reserved(entry: LedgerEntry) -> int:
    """What an engine counts for under the total: what it holds, or its floor if more."""
    return max(entry.mapped_bytes, entry.floor_bytes)


def total_room(table: LedgerTable, me: LedgerEntry) -> int | None:
    """Bytes ``me`` may still take under the device total (None: no total)."""
    if table.total_limit is None:
        return None
    others = sum(reserved(e) for e in table.others(me.name))
    return table.total_limit - others - me.mapped_bytes


def room(table: LedgerTable, me: LedgerEntry) -> int | None:
    """Bytes ``me`` may still take now under its ceiling and the device total (negative:
    it is over; None: no limit applies)."""
    rooms = [r for r in (total_room(table, me),
                         None if me.ceiling_bytes is None else me.ceiling_bytes - me.mapped_bytes)
             if r is not None]
    return min(rooms) if rooms else None


def allowed(table: LedgerTable, me: LedgerEntry) -> int | None:
    """The most ``me`` may hold now (None: no limit)."""
    r = room(table, me)
    return None if r is None else me.mapped_bytes + r


def attainable(table: LedgerTable, me: LedgerEntry) -> int | None:
    """The most ``me`` could hold once others gave back all they hold above their floors
    (None: no limit): whether a request fits at all, as opposed to now."""
    caps = [c for c in (me.ceiling_bytes, None if table.total_limit is None else
                        table.total_limit - sum(e.floor_bytes for e in table.others(me.name)))
            if c is not None]
    return min(caps) if caps else None


def ask_reclaim(table: LedgerTable, me: LedgerEntry, nbytes: int) -> list[LedgerEntry]:
    """``me`` could not take ``nbytes``: record what it waits for and, for what the total
    (not its own ceiling) refuses, ask other engines to give back memory they hold above
    their floors and do not use for live KV, least recently active first. Asks already
    outstanding count. Returns the engines newly asked (to be woken)."""
    own = None if me.ceiling_bytes is None else me.ceiling_bytes - me.mapped_bytes
    under_total = total_room(table, me)
    if under_total is None or (own is not None and own < nbytes):
        me.wanted_bytes = 0
        return []  # its own ceiling refuses: nothing to ask of others
    short = nbytes - max(0, under_total)
    me.wanted_bytes = max(0, short)
    others = table.others(me.name)
    need = short - sum(e.reclaim_bytes for e in others)
    asked = []
    for donor in sorted(others, key=lambda e: (e.active_at, e.name)):
        if need <= 0:
            break
        give = min(need, donor.givable_bytes - donor.reclaim_bytes)
        if give > 0:
            if not donor.reclaim_bytes:
                donor.asked_at = time.time()
            donor.reclaim_bytes += give
            need -= give
            asked.append(donor)
    return asked


def check_total(table: LedgerTable, total: int | None) -> None:
    """A total that cannot hold the engines' floors, or leaves an engine less than one
    of its requests beside the others' floors, is refused in one line."""
    if total is None:
        return
    floors = sum(e.floor_bytes for e in table.engines.values())
    if floors > total:
        raise ConfigError(f"a total of {format_bytes(total)} cannot hold the floors of the "
                          f"engines on this device ({format_bytes(floors)} together); lower "
                          "their floors first (kvmem limit NAME --min SIZE)")
    for e in table.engines.values():
        room = total - (floors - e.floor_bytes)
        if e.request_bytes is not None and room < e.request_bytes:
            raise ConfigError(f"a total of {format_bytes(total)} leaves engine {e.name!r} "
                              f"{format_bytes(room)} beside the others' floors, below one "
                              f"request of its max_model_len ({format_bytes(e.request_bytes)})")


def check_limits(table: LedgerTable, name: str, floor: int, ceiling: int | None,
                 request_bytes: int | None) -> None:
    """An engine's floor and ceiling: refused in one line when the floor is above the
    ceiling, the ceiling below one request of the engine's ``max_model_len``, or the
    floors of all engines together above the device total."""
    if ceiling is not None and floor > ceiling:
        raise ConfigError(f"engine {name!r}: a floor of {format_bytes(floor)} is above its "
                          f"ceiling of {format_bytes(ceiling)}")
    if ceiling is not None and request_bytes is not None and ceiling < request_bytes:
        raise ConfigError(f"engine {name!r}: a ceiling of {format_bytes(ceiling)} is below "
                          f"one request of its max_model_len ({format_bytes(request_bytes)}), "
                          "which then could never run")
    floors = floor + sum(e.floor_bytes for e in table.others(name))
    if table.total_limit is not None and floors > table.total_limit:
        raise ConfigError(f"engine {name!r}: floors would add up to {format_bytes(floors)}, "
                          f"above the device total of {format_bytes(table.total_limit)}")


def set_total(ledger: Ledger, nbytes: int | None) -> None:
    """The limit all engines on ``ledger``'s device share (None: none); refused in one
    line when it cannot hold their floors (``check_total``)."""
    def change(table: LedgerTable) -> None:
        check_total(table, nbytes)
        table.total_limit, table.total_known = nbytes, True

    ledger.change(change)


def set_limits(ledger: Ledger, name: str, *, floor_bytes: int | None,
               ceiling_bytes: int | None, keep_ceiling: bool) -> LedgerEntry:
    """Change engine ``name``'s floor (None: keep it) and its ceiling (``keep_ceiling``,
    or ``ceiling_bytes``, None for none); refused in one line by ``check_limits``."""
    def change(table: LedgerTable) -> LedgerEntry:
        entry = table.engines.get(name)
        if entry is None:
            raise UnknownEngineError(f"no running engine named {name!r} on {ledger.device}")
        floor = entry.floor_bytes if floor_bytes is None else floor_bytes
        ceiling = entry.ceiling_bytes if keep_ceiling else ceiling_bytes
        check_limits(table, name, floor, ceiling, entry.request_bytes)
        entry.floor_bytes, entry.ceiling_bytes = floor, ceiling
        return entry

    return ledger.change(change)  # type: ignore[return-value]
