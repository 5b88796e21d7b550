"""A checkpoint on disk: config.json, safetensors weights (one file or sharded), tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvmem.errors import KvmemError
from kvmem.files import read_bounded

if TYPE_CHECKING:
    import torch

    from kvmem.engine.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"


class ModelLoadError(KvmemError):
    """A model that cannot be found, read or converted."""


@dataclass
class ModelFiles:
    name: str
    path: Path  # the checkpoint directory
    config: dict[str, Any]
    weight_files: list[Path] = field(default_factory=list)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        from kvmem.engine.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HuggingFace name, tensor) for every weight, read lazily file by file."""
        from safetensors import safe_open

        for file in self.weight_files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)


def open_checkpoint_dir(path: Path, name: str | None = None, *, need_weights: bool = True
                        ) -> ModelFiles:
    """Check a checkpoint directory has what the engine needs and describe it."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json in the model directory")
    try:
        config = json.loads(read_bounded(config_path, "model config"))
    except ValueError as e:  # not JSON, or not UTF-8
        raise ModelLoadError(f"{config_path}: cannot read ({e})") from None
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(read_bounded(index, "safetensors index"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a safetensors index ({e})") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files and need_weights:
        raise ModelLoadError(f"{path}: no *.safetensors weights in the model directory")
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ModelLoadError(f"{path}: weight files listed in the index are missing: "
                             f"{', '.join(absent[:3])}")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: no tokenizer.json in the model directory")
    return ModelFiles(name=name or path.name, path=path, config=config,
                      weight_files=files)
