"""A cheap digest of a model's weights, for the identity of a disk tier.

Reading every weight byte of a large checkpoint at start-up would cost seconds to minutes,
so the digest covers what tells two checkpoints apart without it:

- a safetensors file: its name, size and JSON header (names, dtypes, shapes, offsets), and
  a few bytes at the start and middle of every tensor, so a checkpoint trained further, or
  fine-tuned in any of its tensors, digests differently even when its header is the same;
- any other file (a GGUF): its size, modification time, first MiB (header and metadata)
  and evenly spaced samples of the rest.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import xxhash

TENSOR_SAMPLE_BYTES = 64
HEAD_BYTES = 1 << 20
FILE_SAMPLES = 64
FILE_SAMPLE_BYTES = 4096
MAX_SAFETENSORS_HEADER = 100 << 20


def weights_digest(files: Iterable[Path]) -> str:
    """xxh3-128 hex digest of ``files`` (safetensors or other weight files), in order."""
    h = xxhash.xxh3_128()
    for path in files:
        h.update(f"{Path(path).name}\0{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as f:
            if not _safetensors_digest(f, h):
                f.seek(0)
                _sampled_digest(f, os.fstat(f.fileno()), h)
    return h.hexdigest()


def _safetensors_digest(f, h: xxhash.xxh3_128) -> bool:
    """Digest a safetensors file's header and tensor samples; False if it is not one."""
    prefix = f.read(8)
    if len(prefix) < 8:
        return False
    (header_len,) = struct.unpack("<Q", prefix)
    if not 2 <= header_len <= MAX_SAFETENSORS_HEADER:
        return False
    raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(header, dict):
        return False
    h.update(raw)
    base = 8 + header_len
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items()
                   if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v)
    for start, end in spans:
        for offset in dict.fromkeys((start, start + (end - start) // 2)):
            f.seek(base + offset)
            h.update(f.read(min(TENSOR_SAMPLE_BYTES, end - offset)))
    return True


def _sampled_digest(f, stat: os.stat_result, h: xxhash.xxh3_128) -> None:
    """Digest a file's modification time, first MiB and evenly spaced samples."""
    h.update(f"{stat.st_mtime_ns}\0".encode())
    h.update(f.read(HEAD_BYTES))
    rest = stat.st_size - HEAD_BYTES
    if rest <= 0:
        return
    for i in range(FILE_SAMPLES):
        f.seek(HEAD_BYTES + rest * i // FILE_SAMPLES)
        h.update(f.read(FILE_SAMPLE_BYTES))
