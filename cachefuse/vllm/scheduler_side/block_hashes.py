"""Keeping blended blocks out of vLLM's prefix cache for every request but their own.

With prefix caching on, vLLM caches each full block of a request under a hash of its tokens, chained
over the blocks before it (`Request.block_hashes`), and hands a cached block to any later request whose
tokens hash alike. A blended block holds fused K/V, close to but not what a plain prefill computes: served
to a plain request with the same tokens, it would change that request's answer while claiming exactness.

So a fused request's chain is salted from its first block after vLLM's own hit: that block's hash takes
one extra key, a salt unique to the request, and every later block chains from it (vLLM's hasher takes
each block's parent from the list), the decoded ones included. Blocks before it keep vLLM's hashes: they
are vLLM's own hit (exact, shared, never written by cachefuse). Only the request itself can ever hit its
salted blocks, when vLLM preempts and resumes it: its own K/V, the ones its first tokens came from.
A salt is never taken back: once a blend may have written a block, only its request may read it (a blend
that fails leaves blocks vLLM recomputes plain; salted, they are merely not shared).

The salted block may not be full yet (a blend shorter than a block): vLLM hashes it when a decoded token
fills it. So the request's hasher is wrapped (`_SaltingHasher`): it salts that block whenever it is
hashed, and leaves every other block to vLLM's own. This is vLLM's per-request `cache_salt` applied from
a block onward instead of from block 0 (which would also hide the exact prefix vLLM's cache should serve).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens

SALT_KEY = "cachefuse-blend"


@dataclass
class _SaltingHasher:
    """A request's block hasher that salts block `first_block` and chains the rest through `inner`."""

    inner: Any
    """vLLM's hasher of the request (`Request._block_hasher`)."""
    hash_fn: Any
    block_size: int
    first_block: int
    salt: str

    def __call__(self, request: Any) -> list:
        if len(request.block_hashes) != self.first_block:
            return self.inner(request)  # before the salted block, or chaining from it
        start, end = self.first_block * self.block_size, (self.first_block + 1) * self.block_size
        if end > request.num_tokens:
            return []  # not full yet: hashed (salted) when a token fills it
        parent = request.block_hashes[-1] if request.block_hashes else None
        extra = (SALT_KEY, self.salt)
        if self.first_block == 0 and request.cache_salt is not None:
            extra = (request.cache_salt, *extra)
        salted = hash_block_tokens(self.hash_fn, parent, request.all_token_ids[start:end], extra)
        request.block_hashes.append(salted)  # so that vLLM's hasher chains the rest from it
        try:
            return [salted, *self.inner(request)]
        finally:
            request.block_hashes.pop()  # the caller extends the list with what this returns


class BlendHashes:
    """Salts the block hashes of fused requests (scheduler side, one per engine). The salt lives in the
    request's own hasher: it goes with the request."""

    def __init__(self, hash_algo: str, block_size: int) -> None:
        self._hash_fn = get_hash_fn_by_name(hash_algo)
        self.block_size = block_size
        self._counter = itertools.count()
        self._engine_salt = os.urandom(8).hex()  # unique beyond this engine too (no two engines share a cache)

    def salt(self, request: Any, first_block: int) -> None:
        """Salts `request`'s chain from block `first_block` (its first block after vLLM's local hit)."""
        hasher = request._block_hasher
        if hasher is None:
            return  # vLLM hashes nothing: it caches nothing either
        if isinstance(hasher, _SaltingHasher):
            if hasher.first_block <= first_block:
                return  # salted from an earlier block already: the chain from there on is its own
            hasher.first_block = first_block  # a shorter hit (its plain blocks evicted): salted from there
        else:
            salt = f"{self._engine_salt}-{next(self._counter)}"
            request._block_hasher = _SaltingHasher(hasher, self._hash_fn, self.block_size, first_block, salt)
        del request.block_hashes[first_block:]
        request.update_block_hashes()
