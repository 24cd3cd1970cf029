"""A mock worker's prefix cache: which prompt prefixes it holds the KV of, by block.

It works as vLLM's automatic prefix caching does: a prompt's tokens are cut into blocks of
``block_size`` tokens, each *full* block is named by a hash chained over every block before
it (so a block hash names the whole prefix up to its end), and a request's prefix-cache hit
is the run of leading blocks whose hashes the worker already holds. Blocks are kept in
least-recently-used order and bounded in number; a prompt's blocks are touched last block
first, so the tail of a prefix is evicted before the blocks it extends.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from ._text import prompt_tokens_of

#: The default bound of a mock worker's prefix cache, in blocks (of ``block_size`` tokens).
DEFAULT_PREFIX_CACHE_BLOCKS = 4096


def block_hashes(body: Mapping[str, Any], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of ``body``'s prompt, first block first.

    The tokens are the ones :func:`~._text.count_prompt_tokens` counts (a chat's message
    contents in order), so a chat and a completion with the same words share blocks.
    """
    tokens = prompt_tokens_of(body)
    hashes: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = "\x1f".join(map(str, tokens[start:start + block_size])).encode()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """The prompt-prefix blocks one mock worker holds, bounded in blocks, LRU.

    Args:
        block_size: tokens per block (the worker's KV block size).
        capacity_blocks: the most blocks held; 0 disables the cache (every hit is 0).

    Raises:
        ValueError: ``block_size`` < 1 or ``capacity_blocks`` < 0.

    Attributes:
        lookups: prompts looked up (:meth:`lookup`).
        prompt_tokens: the prompt tokens of those lookups, in tokens.
        cached_tokens: the tokens of those found in cache, in tokens.
    """

    def __init__(self, block_size: int, capacity_blocks: int = DEFAULT_PREFIX_CACHE_BLOCKS
                 ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        if capacity_blocks < 0:
            raise ValueError(f"prefix_cache_blocks must be >= 0, got {capacity_blocks}")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.lookups = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def __len__(self) -> int:
        """The blocks held now."""
        return len(self._blocks)

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over every lookup so far (0.0 before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def hashes(self, body: Mapping[str, Any]) -> list[bytes]:
        """:func:`block_hashes` of ``body`` at this cache's block size (none if disabled)."""
        return block_hashes(body, self.block_size) if self.capacity_blocks else []

    def peek(self, hashes: list[bytes], prompt_tokens: int) -> int:
        """The hit :meth:`lookup` would give now, in tokens, touching and counting nothing.

        A whole number of blocks, leaving at least one prompt token to compute (the first
        token needs the last position's logits, as in vLLM).
        """
        matched = 0
        for block in hashes:
            if block not in self._blocks:
                break
            matched += 1
        return min(matched, (prompt_tokens - 1) // self.block_size) * self.block_size

    def lookup(self, hashes: list[bytes], prompt_tokens: int) -> int:
        """A prompt's prefix-cache hit, in tokens (see :meth:`peek`): its hit blocks become
        the most recently used, and the counters count it."""
        cached = self.peek(hashes, prompt_tokens)
        self._touch(hashes[:cached // self.block_size])
        self.lookups += 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached
        return cached

    def insert(self, hashes: list[bytes]) -> None:
        """The prompt's prefill was computed: hold its blocks, evicting the least recently
        used beyond :attr:`capacity_blocks`."""
        if not self.capacity_blocks:
            return
        self._touch(hashes)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def _touch(self, hashes: list[bytes]) -> None:
        # last block first, so a prefix's first blocks are the last evicted
        for block in reversed(hashes):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
