"""Prefix hashing: chained 128-bit block hashes that are stable across processes and restarts.

A block's hash covers its parent's hash, its token ids packed as little-endian uint32 and
the request's extra keys (adapter name, per-tenant cache salt). Chaining makes a hash
identify the whole prefix up to and including the block, so one dictionary lookup per
block finds the longest cached prefix. Only full blocks are hashed. The hash does not
depend on the KV group: the cache map is keyed by ``(group_id, hash)``.

Nothing here uses Python's ``hash()`` (salted per process) or pickle (version dependent).
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

from xxhash import xxh3_128_digest

BlockHash = bytes  # 16 bytes of xxh3_128

# The parent of a request's first block: a fixed constant, so hashes never depend on
# anything but the tokens and the extra keys.
ROOT_PARENT_HASH: BlockHash = b"kvmem-prefix-v1\x00"

_UINT32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the hashed representation)."""
    packed = array(_UINT32)
    try:
        # fromlist is the fastest way from a list of Python ints to packed uint32
        packed.fromlist(token_ids if isinstance(token_ids, list) else list(token_ids))
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


@functools.cache
def block_packer(block_size: int) -> Callable[..., bytes]:
    """``pack(*token_ids)`` for one block: ``block_size`` little-endian uint32."""
    return struct.Struct(f"<{block_size}I").pack


def encode_extra_keys(lora_name: str | None = None, cache_salt: str | None = None,
                      extra: Sequence[str] = ()) -> bytes:
    """The bytes appended to every block hash input: adapter name, cache salt, other keys.

    Each key is tagged, so a salt ``"x"`` and an adapter ``"x"`` hash differently.
    """
    parts = []
    if lora_name:
        parts.append(b"lora\x00" + lora_name.encode())
    if cache_salt:
        parts.append(b"salt\x00" + cache_salt.encode())
    for key in extra:
        parts.append(b"key\x00" + str(key).encode())
    if not parts:
        return b""
    return b"\x01" + b"\x01".join(parts)


def request_extra_keys(request: object) -> bytes:
    """Extra hash keys of an engine request (optional ``lora_name`` and ``cache_salt``)."""
    return encode_extra_keys(getattr(request, "lora_name", None),
                             getattr(request, "cache_salt", None))


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: bytes | Sequence[str] = b"") -> BlockHash:
    """Hash of one full block given its parent's hash (None for a request's first block)."""
    if not isinstance(extra_keys, bytes):
        extra_keys = encode_extra_keys(extra=extra_keys)
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    return xxh3_128_digest(parent + pack_token_ids(token_ids) + extra_keys)


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], num_blocks: int,
                        block_size: int, extra_keys: bytes = b"") -> list[BlockHash]:
    """Append the hashes of blocks ``len(hashes) .. num_blocks - 1`` to ``hashes`` in place.

    The token ids of all new blocks are packed once; each block then costs one slice and
    one xxh3 call. ``token_ids`` must hold at least ``num_blocks * block_size`` tokens.
    """
    start = len(hashes)
    if num_blocks <= start:
        return hashes
    end = num_blocks * block_size
    if len(token_ids) < end:
        raise ValueError(f"{num_blocks} full blocks need {end} tokens, got {len(token_ids)}")
    parent = hashes[-1] if hashes else ROOT_PARENT_HASH
    if num_blocks == start + 1:  # one block (a decode step filled it): one struct.pack
        try:
            packed = block_packer(block_size)(*token_ids[end - block_size:end])
        except struct.error:
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        hashes.append(xxh3_128_digest(parent + packed + extra_keys))
        return hashes
    packed = pack_token_ids(token_ids[start * block_size:end])
    stride = 4 * block_size
    append = hashes.append
    if extra_keys:
        for offset in range(0, len(packed), stride):
            parent = xxh3_128_digest(parent + packed[offset:offset + stride] + extra_keys)
            append(parent)
    else:  # the common case, one concatenation less per block
        for offset in range(0, len(packed), stride):
            parent = xxh3_128_digest(parent + packed[offset:offset + stride])
            append(parent)
    return hashes


def hash_request_tokens(token_ids: Sequence[int], block_size: int,
                        extra_keys: bytes = b"") -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``."""
    return extend_block_hashes([], token_ids, len(token_ids) // block_size, block_size,
                               extra_keys)
