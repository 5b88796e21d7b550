"""The bundled model catalog: HuggingFace ids and short aliases -> config fields.

``catalog()`` holds the models kvmem plans; ``unplanned()`` those whose attention kind it
cannot plan yet (an entry's ``unplanned`` names the kind): their names are known, and
planning one is a one-line ConfigError saying why, never a plan of the wrong layers.
A name the catalog lacks that reads as a Hub repo id (``org/name``) is fetched from the
Hugging Face Hub (``named_spec``, kvmem.spec.hub).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from kvmem.errors import ConfigError, UnknownModelError

if TYPE_CHECKING:
    from kvmem.spec.layout import ModelSpec


@dataclass(frozen=True)
class CatalogEntry:
    hf_id: str
    name: str
    aliases: tuple[str, ...]
    config: dict[str, Any]
    total_params: int | None
    source_quality: str
    notes: str | None
    unplanned: str | None = None  # the kind kvmem cannot plan yet


@cache
def _entries() -> tuple[CatalogEntry, ...]:
    raw = json.loads(resources.files("kvmem.spec").joinpath("catalog/models.json").read_text())
    return tuple(
        CatalogEntry(m["id"], m["name"], tuple(m["aliases"]), m["config"], m.get("total_params"),
                     m.get("source_quality", ""), m.get("notes"), m.get("unplanned"))
        for m in raw["models"]
    )


@cache
def catalog() -> tuple[CatalogEntry, ...]:
    """The models kvmem plans."""
    return tuple(e for e in _entries() if e.unplanned is None)


@cache
def unplanned() -> tuple[CatalogEntry, ...]:
    """Known models whose attention kind kvmem cannot plan yet."""
    return tuple(e for e in _entries() if e.unplanned is not None)


@cache
def _index() -> dict[str, CatalogEntry]:
    index: dict[str, CatalogEntry] = {}
    for entry in _entries():
        for key in (entry.hf_id, entry.name, *entry.aliases):
            index[key.lower()] = entry
    return index


def find_entry(name: str) -> CatalogEntry:
    """Look a model up by HF id, name or alias (case-insensitive); suggest close names."""
    entry = _index().get(name.lower().strip())
    if entry is not None:
        return entry
    raise UnknownModelError(f"unknown model {name!r} (not a path, not in the catalog)"
                            f"{_close_names(name) or '; see `kvmem models`'}")


def _close_names(name: str, cutoff: float = 0.5) -> str:
    close = difflib.get_close_matches(name.lower(), list(_index()), n=3, cutoff=cutoff)
    return f"; did you mean {', '.join(close)}?" if close else ""


def catalog_config(name: str) -> tuple[str, dict[str, Any]]:
    """(display name, config dict) for a catalog model; total_params travels in the config."""
    entry = find_entry(name)
    if entry.unplanned is not None:
        raise ConfigError(f"{entry.hf_id}: kvmem cannot plan {entry.unplanned} yet")
    cfg = dict(entry.config)
    if entry.total_params:
        cfg["total_params"] = entry.total_params
    cfg.setdefault("_name_or_path", entry.hf_id)
    return entry.hf_id, cfg


def named_spec(name: str, *, hub_token: bool | None = None) -> ModelSpec:
    """The model ``name`` stands for: a catalog entry, else the Hub repo of that id
    (``hub_token``: as ``kvmem.spec.hub.hub_spec``'s ``token``)."""
    from kvmem.spec.config import spec_from_config
    from kvmem.spec.hub import hub_spec, is_repo_id

    try:
        entry_name, cfg = catalog_config(name)
    except UnknownModelError:
        if not is_repo_id(name.strip()):
            raise
        try:
            return hub_spec(name.strip(), token=hub_token)
        except ConfigError as e:  # a repo id one letter off a catalog id may be a typo
            raise ConfigError(f"{e}{_close_names(name, cutoff=0.8)}") from None
    return spec_from_config(cfg, name=entry_name)
