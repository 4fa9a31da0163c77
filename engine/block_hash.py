"""Content hashes of full KV blocks, chained: block i's hash covers its token ids and the
hash of block i-1, so equal hashes mean equal prefixes and equal KV (for one model).

The chain starts from a salt naming everything else that changes the KV (the model, its
dtype); BLAKE2b-128 keeps accidental collisions out of reach. Pure Python, no torch: the
router hashes prompts the same way to route on what workers hold.
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16


def root_hash(salt: str) -> bytes:
    """The hash before block 0, for a KV that depends on `salt` (model, dtype, ...)."""
    return hashlib.blake2b(f"pdserve-kv-v1:{salt}".encode(), digest_size=HASH_BYTES).digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """The hash of one full block of `token_ids` following a block whose hash is `parent`."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=HASH_BYTES).digest()


def prefix_hashes(token_ids: list[int], block_size: int, root: bytes) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
