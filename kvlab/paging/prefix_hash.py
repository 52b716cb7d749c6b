"""Block hashes for prefix caching: a chain, so a hash names a block *and its whole prefix*.

``hash(block i) = SHA-256(hash(block i-1) || token ids of block i || extra keys)``, and for
block 0 the parent is a root that mixes in the tenant's cache *salt*. Two blocks with equal
hashes therefore hold the same tokens after the same prefix, for the same tenant: the KV
computed for one is valid for the other. Only full blocks are hashed: a partial block's
content is still changing.
"""
from __future__ import annotations

from hashlib import sha256

import numpy as np

ROOT = b"\x00" * 32


def root_hash(salt: str | bytes | None = None) -> bytes:
    """The parent of a sequence's first block: a constant, or a per-tenant one with a salt."""
    if salt is None:
        return ROOT
    salt = salt.encode() if isinstance(salt, str) else bytes(salt)
    return sha256(b"kvlab-salt" + len(salt).to_bytes(4, "little") + salt).digest()


def token_bytes(token_ids) -> bytes:
    """Token ids as little-endian uint32 bytes (4 per token: vocabularies are < 2**32)."""
    ids = np.asarray(token_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise ValueError("token ids must be in 0 .. 2**32 - 1")
    return ids.astype("<u4", copy=False).tobytes()


def hash_block(parent: bytes, token_ids, extra_keys: tuple = ()) -> bytes:
    """The hash of one full block, given its parent's hash (``root_hash(salt)`` for block 0)."""
    h = sha256(parent + token_bytes(token_ids))
    for key in extra_keys:  # e.g. a LoRA adapter id or an image hash: part of the block's identity
        encoded = repr(key).encode()
        h.update(len(encoded).to_bytes(4, "little") + encoded)  # length first: (1, 23) != (12, 3)
    return h.digest()


def hash_blocks(token_ids, block_size: int, salt: str | bytes | None = None, parent: bytes | None = None) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``, chained from ``parent`` (default: the root).

    The hot loop hashes one slice of a single bytes object per block: no per-block numpy
    or Python-int work, which is what keeps a million tokens to a few tens of milliseconds.
    """
    data = token_bytes(token_ids)
    step = 4 * block_size
    parent = root_hash(salt) if parent is None else parent
    hashes = []
    for start in range(0, len(data) - step + 1, step):
        parent = sha256(parent + data[start:start + step]).digest()
        hashes.append(parent)
    return hashes
