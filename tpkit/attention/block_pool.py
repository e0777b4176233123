"""The physical KV blocks of a paged cache: reference counts, the free list and the prefix cache.

A block is in one of three states:

- in use: held by one or more sequences (its reference count), which share it read-only when several do;
- cached: held by none, but its contents are the K/V of a known run of tokens (it is registered under the
  hash of those tokens and of every token before them), so a later prompt with the same prefix can take it
  back instead of computing it again;
- free: held by none and holding nothing worth keeping.

Allocation takes free blocks first, then evicts cached ones, least recently released first. The hash of a
block chains its tokens onto its predecessor's hash (SHA-256, as vLLM's automatic prefix caching), so equal
hashes mean equal whole prefixes, never just equal last blocks.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

# The hash a sequence's first block chains onto.
ROOT_HASH = hashlib.sha256(b"tpkit prefix cache").digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block of ``token_ids`` after the prefix whose last block hashed to ``parent``."""
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


class BlockPool:
    """``num_blocks`` physical blocks (ids ``0 .. num_blocks - 1``) and their states (see the module doc).

    Methods assume valid arguments (the cache checks them); :meth:`allocate` assumes enough blocks are
    :attr:`num_available`.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        # Popped from the end: the lowest block ids go first, which keeps a fresh cache's tables readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, hashed; oldest first
        self._ref_counts = [0] * num_blocks
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: the free ones and the cached ones (evicted on the way)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached(self) -> int:
        """Blocks held by no sequence whose contents the prefix cache keeps."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, num: int) -> list[int]:
        """``num`` blocks, each now held once: free ones first, then the least recently released cached
        ones, which leave the prefix cache."""
        blocks = []
        for _ in range(num):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                self.unregister(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def hold(self, block: int) -> None:
        """One more holder of ``block`` (a sequence sharing it); a cached block comes back into use."""
        if self._ref_counts[block] == 0:
            del self._cached[block]
        self._ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One holder fewer of each block, in the order given; a block nobody holds any more is cached
        (the most recently released, evicted last) if it is registered, else free."""
        for block in blocks:
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if block in self._hash_of_block:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block registered under ``block_hash``, in use or cached; None if there is none."""
        return self._block_of_hash.get(block_hash)

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of_block

    def register(self, block: int, block_hash: bytes) -> None:
        """``block`` now holds the tokens ``block_hash`` stands for. Where another block already does (the
        same prefix computed twice), that one stays the cached copy and ``block`` stays unregistered."""
        if block_hash not in self._block_of_hash:
            self._block_of_hash[block_hash] = block
            self._hash_of_block[block] = block_hash

    def unregister(self, block: int) -> None:
        """``block``'s contents are about to change (or it was evicted): it no longer stands for its hash."""
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None:
            del self._block_of_hash[block_hash]
