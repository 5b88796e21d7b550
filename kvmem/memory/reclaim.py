"""Giving memory back and asking other engines for it: the routines kvmem's engine
(``ElasticKVStorage``) and vLLM's scheduler side (``integrations.vllm.elastic.pool``)
both run over their page table and budget.

- ``give_back``: about ``nbytes`` back, never below the floor: every wholly free page
  (mapping ahead stops until the engine allocates again), then pages that hold only
  cached blocks, least recently used first, through the engine's ``evict`` (which takes
  them out of its prefix cache, demoting them to a tier first when it has one).
- ``answer``: after a look at the ledger (``BudgetState``), give back what other
  engines asked for or what is over the engine's limit, and tell the ledger.
- ``ask_for_blocks``: the engine's requests need blocks beyond its free ones; ask other
  engines for the pages the device total keeps from it (they are woken at once).
"""

from __future__ import annotations

from collections.abc import Callable
from math import ceil

from kvmem.memory.budget import BudgetState, EngineBudget
from kvmem.memory.page_table import PageTable

Evict = Callable[[list[int]], None]


def trim(table: PageTable) -> None:
    """Unmap every wholly free page above what the engine keeps mapped ahead, and return
    budget taken for pages no longer needed."""
    table.trim_idle()
    while table.maintain_once():
        pass


def give_back(table: PageTable, nbytes: int, floor_bytes: int,
              evict: Evict | None = None) -> int:
    """Give about ``nbytes`` back (see the module docstring); the bytes released."""
    before = table.held_bytes
    with table.cond:
        table.reserve_suspended = True
        pages = min(ceil(nbytes / table.page_bytes),
                    max(0, before - floor_bytes) // table.page_bytes)
    with table.giving_back():
        short = pages - table.idle_pages()
        if evict is not None and short > 0:
            victims = table.cached_victims(short)
            if victims:
                evict(victims)
        trim(table)
    return max(0, before - table.held_bytes)


def due(table: PageTable, state: BudgetState) -> int:
    """The bytes to give back after a look at the ledger: what other engines asked for,
    or what ``table`` holds over the limit."""
    over = 0 if state.allowed_bytes is None else table.held_bytes - state.allowed_bytes
    return max(over, state.reclaim_bytes)


def answer(table: PageTable, budget: EngineBudget, state: BudgetState,
           reclaim: Callable[[int], int]) -> int:
    """Give back what is ``due`` with ``reclaim(nbytes) -> bytes given``; an ask is
    answered in the ledger. Returns the bytes given.

    A state read while an earlier answer was being given may hold the ask that answer
    took care of (a wake-up read the ledger meanwhile): the ledger is read again rather
    than the ask answered twice."""
    if state.reclaim_bytes and state.read_at < budget.answered_at:
        state = budget.peek()
    want = due(table, state)
    if not state.reclaim_bytes:
        return reclaim(want) if want > 0 else 0
    with budget.answering():
        given = reclaim(want) if want > 0 else 0
    # one ledger write: the answer, the bytes released and what it holds live and cached
    # now (an ask read on a wake-up is answered with no heartbeat before it)
    budget.gave_back(given, state, usage=table.usage_bytes())
    return given


def ask_for_blocks(table: PageTable, budget: EngineBudget, blocks: int) -> bool:
    """Requests need ``blocks`` more than the engine holds live: ask other engines for
    the pages the free blocks do not cover; whether some memory is coming."""
    missing = max(0, blocks - table.free_within(0))
    pages = ceil(missing / table.geo.blocks_per_page)
    return pages > 0 and budget.want(pages * table.page_bytes)
