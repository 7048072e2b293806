"""Prefix-cache keys: what a cached block claims to hold.

vLLM keys a full block by a hash over (parent block's hash, the block's token ids, extra
keys such as the LoRA adapter and the cache salt): legacy ``PrefixCachingBlock.hash_block_tokens``
(vllm/core/block/prefix_caching_block.py) and V1 ``hash_block_tokens`` / ``BlockHash``
(vllm/v1/core/kv_cache_utils.py).  The spec's key is the collision-free version of that
hash: the whole chain of tokens from position 0 to the end of the block, plus the extra keys.
Two blocks have equal keys exactly when vLLM's hashes are meant to be equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs


@attrs.frozen(cache_hash=True)
class PrefixKey:
    """The identity of a full block's content: every token up to its end, and the extra keys."""

    chain: tuple[int, ...]
    extra: tuple[object, ...] = ()

    def block_tokens(self, block_size: int) -> tuple[int, ...]:
        """The tokens the keyed block itself holds: the chain's tokens from the start of its
        last block (all ``block_size`` of them for a full block, fewer for a partial one)."""
        return self.chain[self.block_index(block_size) * block_size :]

    def block_index(self, block_size: int) -> int:
        """The block-table index this key belongs at."""
        return (len(self.chain) - 1) // block_size

    def is_full(self, block_size: int) -> bool:
        return len(self.chain) % block_size == 0

    def parent(self, block_size: int) -> PrefixKey | None:
        if len(self.chain) <= block_size:
            return None
        return PrefixKey(self.chain[:-block_size], self.extra)


def block_keys(
    tokens: Sequence[int], block_size: int, extra: tuple[object, ...] = ()
) -> list[PrefixKey]:
    """Keys of every full block of a token sequence, in block-table order."""
    assert block_size >= 1
    full = len(tokens) // block_size
    toks = tuple(tokens)
    return [PrefixKey(toks[: (i + 1) * block_size], extra) for i in range(full)]


def is_well_formed(key: PrefixKey, block_size: int) -> bool:
    """A key names at least one token; a partial last block is allowed (legacy
    BlockSpaceManagerV1 registers a prompt's partial last block under its partial prefix)."""
    return len(key.chain) > 0
