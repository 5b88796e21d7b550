"""Transparent huge pages for CPU KV memory: whether this host's kernel backs a range with
them, and their size.

Releasing a page of KV memory costs the kernel about 0.25 us for every 4-KiB page in it
(``madvise(MADV_DONTNEED)``) and more for a memory file's (``fallocate(PUNCH_HOLE)``); a
2-MiB huge page goes in one step. An elastic CPU cache asked for huge pages maps its pages
in whole huge pages (its page granularity becomes the huge page size) and asks the kernel
to back them so (``MADV_HUGEPAGE``), which needs the kernel's setting for anonymous memory
(``enabled``) and, for the memory files that other processes release pages in, for shared
memory (``shmem_enabled``) to allow it.
"""

from __future__ import annotations

from pathlib import Path

from kvmem.errors import ConfigError

THP_DIR = Path("/sys/kernel/mm/transparent_hugepage")
DEFAULT_SIZE = 2 << 20

# The settings under which a range advised with MADV_HUGEPAGE gets huge pages.
_ANON_OK = {"always", "madvise"}
_SHMEM_OK = {"always", "within_size", "advise", "force"}


def _setting(name: str, root: Path) -> str | None:
    """The selected value of a THP setting (the bracketed word); None when absent."""
    try:
        text = (root / name).read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return text.strip() or None


def huge_page_size(root: Path = THP_DIR) -> int:
    """The kernel's PMD-sized huge page (2 MiB on x86-64)."""
    try:
        return int((root / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return DEFAULT_SIZE


def huge_pages_problem(*, shared: bool, root: Path = THP_DIR) -> str | None:
    """Why huge pages cannot back CPU KV memory here (one line), or None when they can.
    ``shared``: memory files too (tensor-parallel ranks, vLLM's workers)."""
    anon = _setting("enabled", root)
    if anon not in _ANON_OK:
        return (f"transparent huge pages are off on this host ({root / 'enabled'}: "
                f"{anon or 'missing'}); set it to madvise or always")
    if shared:
        shmem = _setting("shmem_enabled", root)
        if shmem not in _SHMEM_OK:
            return (f"this host gives memory files no huge pages ({root / 'shmem_enabled'}: "
                    f"{shmem or 'missing'}); set it to advise, or leave huge pages off")
    return None


def check_huge_pages(*, shared: bool, what: str = "huge pages for the KV cache") -> int:
    """The huge page size, or a ``ConfigError`` saying why ``what`` cannot be had here."""
    problem = huge_pages_problem(shared=shared)
    if problem:
        raise ConfigError(f"{what}: {problem}")
    return huge_page_size()
