"""Hypothesis strategies for configurations and prompts, following the generator rules
(testing/generator_rules.py).

Windows are drawn by their relation to the block size (W < B, W = B, W mod B in {0, 1},
anything), because that relation is where window arithmetic breaks.  Prompts are drawn
from earlier prompts (cut and extended) so that prefix caching and sharing get exercised.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st
from kvspec.spec.config import Config
from kvspec.spec.prefix_hash import NO_EXTRA, ExtraKeys, MMFeature
from kvspec.testing import generator_rules as rules
from kvspec.testing.generator_rules import block_relative, identifiers, pool_blocks, prompt_length, repeats_prefix

BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 8, 16])
BOTH = st.booleans()


@st.composite
def windows(draw, block_size: int, required: bool = False) -> int | None:
    """A window size (rule ``block-relative``), or None (full attention) unless ``required``."""
    sizes = block_relative(block_size)
    return draw(sizes if required else st.one_of(st.none(), sizes))


@st.composite
def configs(
    draw,
    *,
    block_sizes: st.SearchStrategy[int] = BLOCK_SIZES,
    max_blocks: int = 32,
    prefix_caching: st.SearchStrategy[bool] = BOTH,
    sliding_window: bool = True,
    swap: bool = True,
    max_lookahead: int = 3,
    require_window: bool = False,
    min_cpu_blocks: int = 0,
    min_lookahead: int = 0,
) -> Config:
    """A configuration; the ``require_``/``min_`` arguments pin a feature on (a window, a
    CPU pool for swapping, lookahead slots) without changing what the defaults draw."""
    B = draw(block_sizes)
    window = sliding_window or require_window
    return Config(
        block_size=B,
        num_blocks=draw(pool_blocks(max_blocks)),
        num_cpu_blocks=draw(st.integers(min_cpu_blocks, max(8, min_cpu_blocks))) if swap else 0,
        sliding_window=draw(windows(B, required=require_window)) if window else None,
        prefix_caching=draw(prefix_caching),
        max_lookahead=draw(st.integers(min_lookahead, max(max_lookahead, min_lookahead))),
    )


# The machine's choices travel as byte strings: few hypothesis draws per operation
# (per-draw overhead was most of the oracle's time), and bytes shrink towards 0 one position
# at a time -- a fresh prompt, no shared prefix, the whole remainder, token 0.
# source, cut, chunk, next token, length (two), domain, multimodal (kind, position, length);
# then the prompt's tokens
ADMISSION_HEADER = 10
MAX_TAIL = 96  # prompt tokens one admission draws (the prompt may extend an earlier one)
admission_bytes = st.binary(min_size=ADMISSION_HEADER, max_size=ADMISSION_HEADER + MAX_TAIL)


def as_tokens(raw: bytes) -> tuple[int, ...]:
    return tuple(rules.token(b) for b in raw)


def extended_index(raw: bytes, earlier: Sequence[tuple[int, ...]], block_size: int, repeat_blocks: int = 0) -> int:
    """The index in ``earlier`` of the prompt an admission's bytes extend, if it extends one
    (``prompt_from``): counted back from the newest prompt, so that the shrinker can drop older
    admissions without changing which prompt this one extends; with ``repeat_blocks``, the
    longest one if the one counted is shorter than that many blocks."""
    index = len(earlier) - 1 - (raw[0] // 4) % len(earlier)
    if len(earlier[index]) < repeat_blocks * block_size:
        index = max(range(len(earlier)), key=lambda i: len(earlier[i]))
    return index


def extended_from(
    raw: bytes, earlier: Sequence[tuple[int, ...]], block_size: int, repeat_blocks: int = 0
) -> int | None:
    """The index in ``earlier`` of the prompt ``prompt_from`` extends with these bytes, or None
    when it draws a fresh prompt (rule ``shared-prefixes``)."""
    if not earlier or not (repeat_blocks or repeats_prefix(raw[0])):
        return None
    return extended_index(raw, earlier, block_size, repeat_blocks)


def prompt_from(
    raw: bytes,
    earlier: Sequence[tuple[int, ...]],
    block_size: int,
    max_len: int,
    *,
    budget: int | None = None,
    capacity: int | None = None,
    repeat_blocks: int = 0,
) -> tuple[int, ...]:
    """A prompt from an admission's bytes: usually an earlier prompt cut and extended (so that
    prefixes are shared), cut at a block boundary half of the time (that is where cache hits
    happen).  Its length is drawn apart from its content (``generator_rules.prompt_length``:
    mostly the product of two bytes, sometimes an edge: a block boundary, ``max_len``, the
    token ``budget``, the pool's ``capacity`` in tokens), so the shrinker can make the prompt
    fresh and its tokens 0 without losing the length a failure needs.  ``repeat_blocks``
    (``generator_rules.eagle_repeated_blocks``): with an earlier prompt, always extend one (the
    longest if the one drawn is shorter than this many blocks) by at least this many whole
    blocks (as many as it has), and run at least one token past them (``extended_index`` says
    which)."""
    cut_code, len_a, len_b = raw[1], raw[4], raw[5]
    length = prompt_length(len_a, len_b, max_len, block_size, budget=budget, capacity=capacity)
    tail = as_tokens(raw[ADMISSION_HEADER:])
    extended = extended_from(raw, earlier, block_size, repeat_blocks)
    if extended is None:
        prefix: tuple[int, ...] = ()
    else:
        base = earlier[extended]
        if cut_code % 2 == 0:
            cut = (cut_code // 2) % (len(base) // block_size + 1) * block_size
        else:
            cut = (cut_code // 2) % (len(base) + 1)
        if repeat_blocks:
            cut = max(cut, min(repeat_blocks, len(base) // block_size) * block_size)
            length = max(length, min(cut + 1, max_len))
        prefix = base[:cut]
    prompt = (prefix + tail)[:length]
    return prompt + (rules.token(0),) * (length - len(prompt))


EXTRA_KINDS = frozenset({"cache_salt", "lora", "mm"})


def extra_from(
    raw: bytes, prompt_len: int, block_size: int, kinds=EXTRA_KINDS, extended: ExtraKeys | None = None
) -> ExtraKeys:
    """A request's domain from an admission's bytes 6-9 (0 everywhere: the plain domain): a
    cache salt, a LoRA adapter, and up to two multimodal features placed inside the prompt
    (the second after the first), each only if ``kinds`` allows it.  A few names only, shared
    by the kinds (rule ``shared-identifiers``): identical prompts in different domains, and
    identifiers of different kinds that coincide, happen often.  ``extended``: the domain of
    the request whose prompt this one extends (``extended_from``), which rule ``moved-media``
    may repeat with its media moved (``moved``)."""
    domain, mm_code, pos, size = raw[6:ADMISSION_HEADER]
    if extended is not None and extended.mm and "mm" in kinds and rules.moves_media(domain):
        return moved(extended, prompt_len, -1 if pos % 2 else 1, kinds)
    salts = (None, *identifiers("cache_salt"))
    loras = (None, *identifiers("lora"))
    images = identifiers("mm")
    salt = salts[domain % len(salts)] if "cache_salt" in kinds else None
    lora = loras[(domain // len(salts)) % len(loras)] if "lora" in kinds else None
    features: list[MMFeature] = []
    if "mm" in kinds and prompt_len:
        count = mm_code % 3
        offset = pos % prompt_len
        for n in range(count):
            if offset >= prompt_len:
                break
            length = 1 + (size >> (4 * n) & 15) % min(2 * block_size, prompt_len - offset)
            image = images[(mm_code // 3 >> n) % len(images)]
            features.append(MMFeature(image, offset, length))
            offset += length + (pos >> 4) % 3
    if not (salt or lora or features):
        return NO_EXTRA
    return ExtraKeys(salt, lora, tuple(features))


def one_length_per_identifier(extra: ExtraKeys, earlier: Sequence[ExtraKeys], prompt_len: int) -> ExtraKeys:
    """``extra`` with each multimodal item as long as its identifier was where it was drawn
    first (in ``earlier``, then in ``extra``), dropping an item that would then run past the
    prompt or into the item before it.  An identifier is a content hash, so one identifier has
    one placeholder count, and the spec's key names an item by identifier and offset alone
    (spec/prefix_hash.py ``ExtraKeys.for_chain``); one identifier drawn at two lengths would be
    two items vLLM keys apart (0.33.0 kv_cache_utils.py:564-574: a block gets an item's key
    only where the item overlaps it) while the spec's key calls them one."""
    lengths: dict[str, int] = {}
    for e in earlier:
        for f in e.mm:
            lengths.setdefault(f.identifier, f.length)
    kept: list[MMFeature] = []
    for f in extra.mm:
        item = MMFeature(f.identifier, f.offset, lengths.setdefault(f.identifier, f.length))
        if item.end <= prompt_len and (not kept or kept[-1].end <= item.offset):
            kept.append(item)
    if tuple(kept) == extra.mm:
        return extra
    if not (extra.cache_salt or extra.lora or kept):
        return NO_EXTRA
    return ExtraKeys(extra.cache_salt, extra.lora, tuple(kept))


def moved(extra: ExtraKeys, prompt_len: int, shift: int, kinds=EXTRA_KINDS) -> ExtraKeys:
    """Rule ``moved-media``: ``extra``'s salt and adapter (as ``kinds`` allows) with its
    multimodal items, those that start inside a prompt of ``prompt_len`` tokens, all moved by
    ``shift`` positions (the other way where that leaves the prompt, not at all where neither
    fits) and cut to the prompt."""
    items = [f for f in extra.mm if f.offset < prompt_len]
    fits = [d for d in (shift, -shift) if items and all(0 <= f.offset + d < prompt_len for f in items)]
    d = fits[0] if fits else 0
    features = tuple(
        MMFeature(f.identifier, f.offset + d, min(f.length, prompt_len - f.offset - d)) for f in items
    )
    salt = extra.cache_salt if "cache_salt" in kinds else None
    lora = extra.lora if "lora" in kinds else None
    if not (salt or lora or features):
        return NO_EXTRA
    return ExtraKeys(salt, lora, features)


@st.composite
def prompts(
    draw, earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    return prompt_from(draw(admission_bytes), earlier, block_size, max_len)
