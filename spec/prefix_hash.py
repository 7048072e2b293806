"""Prefix-cache keys: what a cached block claims to hold, and in which domain.

vLLM keys a full block by a hash over (parent block's hash, the block's token ids, extra
keys such as the LoRA adapter and the cache salt): legacy ``PrefixCachingBlock.hash_block_tokens``
(vllm/core/block/prefix_caching_block.py) and V1 ``hash_block_tokens`` / ``BlockHash``
(vllm/v1/core/kv_cache_utils.py).  The spec's key is the collision-free version of that
hash: the whole chain of tokens from position 0 to the end of the block, plus the extra keys.
Two blocks have equal keys exactly when vLLM's hashes are meant to be equal.

Extra keys (``ExtraKeys``) name the *domain* a request's KV belongs to, beyond its tokens.
vLLM 0.33.0 ``generate_block_hash_extra_keys`` (kv_cache_utils.py:637-675) puts into a
block's hash: ``("lora", lora_name, lora_path)`` for every block of a LoRA request (590-607;
0.8.x-0.10.x: the adapter's int id), ``("mm", identifier, offset - block start)`` for every
multimodal feature the block overlaps (522-587), and ``("cache_salt", salt)`` for the first
block only (659-662; later blocks inherit it through the parent hash).  Because the hash
chains, the key of a block ending at token ``end`` depends on the salt, the adapter and every
feature placed before ``end``: ``ExtraKeys.for_chain`` is that dependency, canonical.  It names
a feature by identifier and offset, not length: the identifier is a content hash, so one
identifier has one placeholder count (vLLM's hash depends on which blocks a feature overlaps,
kv_cache_utils.py:564-574, which its identifier and offset then fix); the machines draw one
length per identifier (testing/blockmanager/strategies.py ``one_length_per_identifier``).
Identical tokens in two domains are different content (KV computed under another adapter,
or over another image behind the same placeholder tokens): invariant
``prefix-cache-isolation``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .errors import ConfigError


@attrs.frozen(cache_hash=True)
class MMFeature:
    """One multimodal input's placement: its content hash (vLLM's
    ``MultiModalFeatureSpec.identifier``) over prompt positions ``offset .. offset+length-1``
    (``PlaceholderRange``)."""

    identifier: str
    offset: int
    length: int

    def __attrs_post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ConfigError(f"a multimodal placement needs offset >= 0, length >= 1: {self}")

    @property
    def end(self) -> int:
        return self.offset + self.length


@attrs.frozen(cache_hash=True)
class ExtraKeys:
    """A request's domain beyond its tokens: cache salt, LoRA adapter, multimodal features
    (sorted by offset, not overlapping, as vLLM assumes: kv_cache_utils.py:546).  Empty
    (the default) is the plain domain; an empty salt is no salt (vLLM tests its truth)."""

    cache_salt: str | None = None
    lora: str | None = None
    mm: tuple[MMFeature, ...] = ()

    def __attrs_post_init__(self) -> None:
        for a, b in zip(self.mm, self.mm[1:], strict=False):
            if b.offset < a.end:
                raise ConfigError(f"multimodal placements overlap or are unsorted: {a}, {b}")

    def __bool__(self) -> bool:
        return bool(self.cache_salt or self.lora or self.mm)

    def for_chain(self, end: int) -> tuple[object, ...]:
        """The canonical extra part of the key of a block whose chain ends at token ``end``:
        what vLLM's chained hash of that block depends on beyond the tokens."""
        parts: list[object] = []
        if self.cache_salt:
            parts.append(("cache_salt", self.cache_salt))
        if self.lora:
            parts.append(("lora", self.lora))
        parts.extend(("mm", f.identifier, f.offset) for f in self.mm if f.offset < end)
        return tuple(parts)

    def kinds(self) -> frozenset[str]:
        """Which kinds of extra key this domain uses ("cache_salt", "lora", "mm")."""
        used = {"cache_salt": bool(self.cache_salt), "lora": bool(self.lora), "mm": bool(self.mm)}
        return frozenset(k for k, on in used.items() if on)

    def describe(self) -> str:
        parts = []
        if self.cache_salt:
            parts.append(f"salt={self.cache_salt}")
        if self.lora:
            parts.append(f"lora={self.lora}")
        parts.extend(f"mm={f.identifier}@{f.offset}+{f.length}" for f in self.mm)
        return ",".join(parts) or "plain"

    def to_json(self) -> dict:
        return {
            "cache_salt": self.cache_salt,
            "lora": self.lora,
            "mm": [[f.identifier, f.offset, f.length] for f in self.mm],
        }

    @classmethod
    def from_json(cls, data: dict | None) -> ExtraKeys:
        if not data:
            return NO_EXTRA
        return cls(
            data.get("cache_salt"),
            data.get("lora"),
            tuple(MMFeature(i, o, n) for i, o, n in data.get("mm", ())),
        )


NO_EXTRA = ExtraKeys()


def as_extra(extra: ExtraKeys | tuple | None) -> ExtraKeys:
    """An ``ExtraKeys`` from what a caller passed (``()``/None: the plain domain)."""
    if isinstance(extra, ExtraKeys):
        return extra
    if extra:
        raise ConfigError(f"extra keys must be an ExtraKeys, got {extra!r}")
    return NO_EXTRA


@attrs.frozen(cache_hash=True)
class PrefixKey:
    """The identity of a block's content: every token up to its end, and the extra keys the
    chain depends on (``ExtraKeys.for_chain``)."""

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
        end = (self.block_index(block_size)) * block_size
        return PrefixKey(self.chain[:end], tuple(e for e in self.extra if _before(e, end)))


@attrs.frozen
class HashCollision:
    """One block hash a release gave two different keys: the key learned first under it, the
    key that met it, and the sequences whose blocks carried the first and the second (those the
    observer knows, in that order)."""

    hash: object
    first: PrefixKey
    second: PrefixKey
    seqs: tuple[int, ...] = ()

    @property
    def same_tokens(self) -> bool:
        """Equal chains: what the hash failed to tell apart is the domain (extra keys)."""
        return self.first.chain == self.second.chain


def confused_domains(a: tuple[object, ...], b: tuple[object, ...]) -> tuple[str, ...]:
    """The kinds of extra key ("cache_salt", "lora", "mm") whose parts tell one key's extra part
    (``PrefixKey.extra``) from another's, sorted: which domains a block or a hash that stands for
    both confused (a LoRA name against a cache salt gives ``("cache_salt", "lora")``)."""
    differ = set(a) ^ set(b)
    return tuple(sorted({str(part[0]) for part in differ if isinstance(part, tuple) and part}))


def _before(part: object, end: int) -> bool:
    # A multimodal part belongs to a chain only if its feature starts before the chain's end.
    return not (isinstance(part, tuple) and part and part[0] == "mm" and part[2] >= end)


def key_of(tokens: Sequence[int], end: int, extra: ExtraKeys = NO_EXTRA) -> PrefixKey:
    """The key of the block whose chain is ``tokens[:end]``, in ``extra``'s domain."""
    return PrefixKey(tuple(tokens[:end]), extra.for_chain(end))


def block_keys(
    tokens: Sequence[int], block_size: int, extra: ExtraKeys = NO_EXTRA
) -> list[PrefixKey]:
    """Keys of every full block of a token sequence, in block-table order."""
    assert block_size >= 1
    full = len(tokens) // block_size
    toks = tuple(tokens)
    return [key_of(toks, (i + 1) * block_size, extra) for i in range(full)]


def is_well_formed(key: PrefixKey, block_size: int) -> bool:
    """A key names at least one token; a partial last block is allowed (legacy
    BlockSpaceManagerV1 registers a prompt's partial last block under its partial prefix)."""
    return len(key.chain) > 0
