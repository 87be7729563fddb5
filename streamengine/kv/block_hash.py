"""Content hashes of full KV blocks: chained BLAKE2b over tokens, parent hash and salt.

What the prefix cache (block_manager.py) keys blocks by, and what a router computes to find
the engine holding a request's blocks.

Salts and isolation
-------------------
Block i (tokens [i*bs, (i+1)*bs)) is hashed as H(hash of block i-1, its tokens, its salt), H
being 128-bit BLAKE2b. Its salt is that of the last of `Sequence.salt_segments` starting at or
before the block's last token (`cache_salt` with no segments, or before the first one), so a
block holding the end of a shared segment and the start of the next takes the next one's salt.
A lookup is an exact match of hashes, so a request hits a cached block only if it computes that
block's hash itself: the same tokens, the same whole prefix before them, the same salt.

Everything a request can learn from the prefix cache (how many of its blocks hit, hence its
`num_cached_tokens`, how many tokens it computes and so its prefill time; whether the scheduler
holds it back for a prefix in flight, also an exact hash match) is a function of which of its
own hashes are cached. Of those:
- a block hashed with salt s matches only lookups hashed with s. A tenant's salt is secret to
  other tenants, so no other tenant computes the hash of any of its private blocks, whatever
  tokens it sends (short of a BLAKE2b collision); through the chain, nor of any block after one;
- the engine leaves only a leading segment unsalted, over a shared pinned prefix, so an
  unsalted block holds only that prefix's tokens (its last token is in the segment, hence all
  before it are). The prefix is public and, while pinned, always cached: its hit tells nothing;
- a per-user salt after the tenant's segment separates one tenant's users the same way, if it
  combines the tenant's secret salt with the user's: a user salt alone anyone can send, and the
  block before it may be an unsalted one that anyone can compute.
Not covered: load. Other tenants' traffic changes queueing delays, admission order and how soon
one's own unpinned blocks are evicted; that shows how much others use, not their tokens.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamengine.sequence import Sequence


def hash_block(parent: bytes | None, token_ids: list[int], extra: str | None) -> bytes:
    """Chained content hash of one full block, stable across processes and machines.

    The parent hash makes a block's identity depend on the whole prefix; `extra` (the block's
    salt) separates tenants and users: see "Salts and isolation" above.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra is not None:
        h.update(b"\x00salt:" + extra.encode())
    return h.digest()


def prompt_block_hashes(
    token_ids: list[int], block_size: int, salt_segments: tuple[tuple[int, str | None], ...] = (),
    cache_salt: str | None = None,
) -> list[bytes]:
    """The chained hashes of every full block of `token_ids`, salted as a sequence with these
    `salt_segments` and `cache_salt` is (see "Salts and isolation"): what a router computes to
    find the engine that holds a request's blocks."""
    return extend_hashes([], token_ids, block_size, salt_segments, cache_salt)


def extend_hashes(
    hashes: list[bytes], token_ids: list[int], block_size: int,
    salt_segments: tuple[tuple[int, str | None], ...], cache_salt: str | None,
) -> list[bytes]:
    """Appends to `hashes` (those of the leading blocks) the hashes of the remaining full blocks."""
    bs = block_size
    for i in range(len(hashes), len(token_ids) // bs):
        parent = hashes[i - 1] if i else None
        salt = segment_salt(salt_segments, cache_salt, (i + 1) * bs - 1)
        hashes.append(hash_block(parent, token_ids[i * bs:(i + 1) * bs], salt))
    return hashes


def sequence_hashes(seq: Sequence, block_size: int) -> list[bytes]:
    """Extends `seq.block_hashes` to cover every full block of its known tokens; returns it."""
    return extend_hashes(seq.block_hashes, seq.token_ids, block_size, seq.salt_segments, seq.cache_salt)


def segment_salt(
    salt_segments: tuple[tuple[int, str | None], ...], cache_salt: str | None, last_token: int,
) -> str | None:
    """The salt of the segment holding `last_token`; tokens before the first segment, or a
    sequence with none, get `cache_salt`."""
    for start, salt in reversed(salt_segments):
        if start <= last_token:
            return salt
    return cache_salt
