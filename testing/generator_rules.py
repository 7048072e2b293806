"""The rules every strategy follows: the edges a generator must be able to produce, because a
generator that never produces a value cannot find the bug that needs it.

Each rule is a ``Rule`` with its statement as the docstring of the function that applies it;
the strategies (testing/blockmanager/strategies.py for the block-manager machine, ``shapes`` and
``SchedulerMachine.arrive`` in testing/scheduler/machine.py) go through these functions, so a
rule holds for both machines.  Every rule can be switched off (``Rule.on``) only so that
tests/test_generator_rules.py can show that its edge then disappears: each test is able to
fail.

The rules:

``shared-identifiers``  cache salts, LoRA adapter names and media ids come from one small pool
                        that also holds the names requests get, so identifiers of different
                        kinds coincide;
``special-tokens``      token ids include the ids the tokenizer reserves;
``block-relative``      windows and attention chunks fall below, at and above the block size
                        and off its multiples;
``pool-edges``          pools at the startup minimum, and prompts that fill a pool exactly;
``prompt-edges``        prompt lengths on block boundaries, at the token budget and at the
                        longest length allowed;
``shared-prefixes``     prompts repeat earlier prompts' prefixes, in whatever domain (tenant,
                        adapter, media) the new request draws;
``eagle-prefix-hits``   under an EAGLE head, prefix caching is on (vLLM's default) most of the
                        time, and where the head drops a hit's last block every admission after
                        the first repeats at least two whole blocks of an earlier prompt;
``swapped-aborts``      an abort (``free``) picks a swapped-out request half of the time when
                        there is one;
``moved-media``         a request that repeats an earlier multimodal prompt's prefix sometimes
                        carries that request's salt, adapter and media with the media moved by
                        one position: the same item at another offset over the same tokens;
``decode-relative``     a chunked token budget of a shape with drafts falls, half of the time,
                        at and around what one decode step takes (its token, its drafts and an
                        EAGLE head's lookahead slots) rather than anywhere below the context,
                        and never at or below those slots (vLLM refuses such a budget);
``lone-requests``       at the startup minimum, one example in eight admits one request only,
                        never aborts it, and makes it fill the context: the request vLLM's
                        startup sizing promises to run.
"""

from __future__ import annotations

import attrs
from hypothesis import strategies as st


@attrs.define
class Rule:
    """A generator rule; ``on`` is False only in the tests that show the rule is needed."""

    name: str
    on: bool = True


RULES = tuple(
    Rule(name)
    for name in (
        "shared-identifiers",
        "special-tokens",
        "block-relative",
        "pool-edges",
        "prompt-edges",
        "shared-prefixes",
        "eagle-prefix-hits",
        "swapped-aborts",
        "moved-media",
        "decode-relative",
        "lone-requests",
    )
)
(
    SHARED_IDENTIFIERS,
    SPECIAL_TOKENS,
    BLOCK_RELATIVE,
    POOL_EDGES,
    PROMPT_EDGES,
    SHARED_PREFIXES,
    EAGLE_PREFIX_HITS,
    SWAPPED_ABORTS,
    MOVED_MEDIA,
    DECODE_RELATIVE,
    LONE_REQUESTS,
) = RULES

# ------------------------------------------------------------------------------ identifiers

# The names the V1 scheduler adapter gives the first requests (adapters/v1_scheduler.py
# ``request_id=f"seq{seq_id}"``): a salt, an adapter or an image of the same name is an
# identifier that coincides with a request id.
REQUEST_NAMED = ("seq0", "seq1")
# What each kind drew from when the pools were disjoint (the rule switched off).
DISJOINT = {
    "cache_salt": ("tenant-a", "tenant-b"),
    "lora": ("adapter-1", "adapter-2"),
    "mm": ("image-x", "image-y"),
}


def identifiers(kind: str) -> tuple[str, ...]:
    """Rule ``shared-identifiers``: every kind of identifier (``cache_salt``, ``lora``, ``mm``)
    draws from the same two names, which are also the names of the first two requests.  Two
    names keep the domains few (identical prompts in one domain stay common) while a salt can
    equal an adapter's name, an image's id or a request's id: a cache key that drops the kind
    of an identifier (a salt ``x`` and an adapter ``x`` hashed alike) is then reachable."""
    return REQUEST_NAMED if SHARED_IDENTIFIERS.on else DISJOINT[kind]


# ------------------------------------------------------------------------------ tokens

ALPHABET = 4  # few distinct tokens: shared prefixes and equal blocks happen often
# The ids the offline tokenizer reserves (adapters/v1_scheduler.py ``_tiny_tokenizer``: unk,
# bos, eos are TINY_VOCAB's first three words), the ids tokenizers commonly reserve.
SPECIAL_TOKENS_IDS = (0, 1, 2)


def token(byte: int) -> int:
    """Rule ``special-tokens``: a token id from a byte, over ``ALPHABET`` ids that include the
    reserved ones (``SPECIAL_TOKENS_IDS``): a prompt may hold an unk, bos or eos id anywhere,
    as prompts from users and from chat templates do."""
    offset = 0 if SPECIAL_TOKENS.on else len(SPECIAL_TOKENS_IDS)
    return offset + byte % ALPHABET


# ------------------------------------------------------------------------------ windows, chunks


def block_relative(block_size: int) -> st.SearchStrategy[int]:
    """Rule ``block-relative``: a window or attention-chunk size drawn by its relation to the
    block size B, where window arithmetic breaks: B itself, multiples of B, one past a
    multiple, below B, and anything up to 4B + 3 (mostly not a multiple)."""
    B = block_size
    multiples = st.integers(1, 4).map(lambda m: m * B)
    if not BLOCK_RELATIVE.on:
        return multiples
    options = [
        st.just(B),
        multiples,
        st.integers(1, 4).map(lambda m: m * B + 1),
        st.integers(1, 4 * B + 3),
    ]
    if B > 1:
        options.append(st.integers(1, B - 1))
    return st.one_of(options)


# ------------------------------------------------------------------------------ pools

SPARE_BLOCKS = (0, 0, 1, 2, 4, 8)  # blocks a scheduler's pool has beyond its startup minimum


def spare_blocks() -> st.SearchStrategy[int]:
    """Rule ``pool-edges`` (scheduler shapes): the pool has 0 blocks beyond the startup minimum
    (vLLM's: one request of ``max_model_len`` fits) a third of the time, a few more otherwise."""
    if POOL_EDGES.on:
        return st.sampled_from(SPARE_BLOCKS)
    return st.sampled_from([n for n in SPARE_BLOCKS if n > 0])


def pool_blocks(max_blocks: int) -> st.SearchStrategy[int]:
    """Rule ``pool-edges`` (block-manager configurations): from one block (the smallest pool a
    manager starts with) to ``max_blocks``."""
    return st.integers(1 if POOL_EDGES.on else 2, max_blocks)


# ------------------------------------------------------------------------------ prompt lengths

EDGE_CODE = 16  # one first length byte in this many snaps the length to an edge ...
EDGE_SECOND = 128  # ... when the second length byte is at least this: lowering it leaves the edge


def prompt_length(
    len_a: int,
    len_b: int,
    max_len: int,
    block_size: int,
    *,
    budget: int | None = None,
    capacity: int | None = None,
) -> int:
    """Rules ``prompt-edges`` and ``pool-edges``: a prompt's length from two bytes.  Mostly
    their product scaled to ``max_len`` (short prompts are the common case on small pools);
    one draw in ``2 * EDGE_CODE`` lands on an edge instead: a block boundary, ``max_len`` itself
    (the longest prompt the caller allows), the scheduler's token ``budget``, or the pool's
    ``capacity`` in tokens (a prompt that fills the pool exactly).  Edges past ``max_len`` are
    cut to it.  A rule switched off: its edges are never the length."""
    length = 1 + len_a * len_b * max_len // 65536
    # The edge needs a high second byte, so that the shrinker, which lowers every byte, can
    # always leave an edge for the plain length below it (a failure that needs no edge shrinks
    # as far as it did without the rule).
    if len_a % EDGE_CODE == EDGE_CODE - 1 and len_b >= EDGE_SECOND:
        boundary = block_size * (1 + len_b % max(1, max_len // block_size))
        choices = [boundary, max_len, *(e for e in (budget, capacity) if e)]
        length = max(1, min(choices[(len_b // 7) % len(choices)], max_len))
    avoided = set()
    if not PROMPT_EDGES.on:
        avoided |= {max_len, budget}
    if not POOL_EDGES.on:
        avoided.add(capacity)
    while length in avoided and length > 1:
        length -= 1
    return length


def repeats_prefix(source: int) -> bool:
    """Rule ``shared-prefixes``: three admissions in four extend an earlier prompt (cut at a
    block boundary half of the time), whatever domain the new request draws, so the same
    prefix arrives under other tenants, adapters and images."""
    return SHARED_PREFIXES.on and source % 4 != 0


# ------------------------------------------------------------------------------ aborts

SWAPPED_ABORT_FROM = 128  # a pick code at least this aborts a swapped-out request


def aborts_swapped(pick_code: int) -> bool:
    """Rule ``swapped-aborts``: an abort (the machine's ``free``) picks among the swapped-out
    requests, when there are any, if its pick code (0..255) is at least ``SWAPPED_ABORT_FROM``
    (half of the draws); otherwise among every request.  A request aborted while swapped out
    frees blocks the CPU pool holds for a table the GPU allocator built (FINDINGS F13); picked
    uniformly, the swapped-out request is one of several live ones, and the example usually
    swaps it back in or ends first.  Shrinking lowers the code and leaves the edge."""
    return SWAPPED_ABORTS.on and pick_code >= SWAPPED_ABORT_FROM


# ------------------------------------------------------------------------------ media

MOVED_MEDIA_FROM = 192  # a domain byte at least this moves the extended request's media


def moves_media(domain_byte: int) -> bool:
    """Rule ``moved-media``: an admission that extends an earlier prompt which carried media
    takes that request's whole domain (salt, adapter, items) with every item moved by one
    position, when its domain byte is at least ``MOVED_MEDIA_FROM`` (one draw in four).  The
    same item at another offset over the same tokens is what a key that leaves out where an
    item starts in its block cannot tell apart (FINDINGS F-KV3); drawn independently, the
    salt, the adapter, the identifier and a nearby offset all agree about one pair of
    admissions in a hundred examples.  The edge needs a high byte, so the shrinker, which
    lowers every byte, can always leave it for an independently drawn domain."""
    return MOVED_MEDIA.on and domain_byte >= MOVED_MEDIA_FROM


# ------------------------------------------------------------------------------ EAGLE

EAGLE_REPEATED_BLOCKS = 2  # whole blocks an admission repeats under a block-dropping EAGLE head


def eagle_caches(draw_byte: int) -> bool:
    """Rule ``eagle-prefix-hits`` (scheduler shapes): an EAGLE shape drawn without prefix caching
    turns it on two times in three (``draw_byte``: a draw in 0..2), since vLLM's default is on
    and an EAGLE head changes prefix hits only when there are some."""
    return EAGLE_PREFIX_HITS.on and draw_byte != 0


def eagle_repeated_blocks(drops_hit_block: bool) -> int:
    """Rule ``eagle-prefix-hits`` (admissions): under an EAGLE head that drops a prefix hit's
    last block (vLLM 0.33.0 ``FullAttentionManager.find_longest_cache_hit``,
    single_type_kv_cache_manager.py:826-830; 0.12.0 and before, every EAGLE head), every
    admission after the first repeats at least ``EAGLE_REPEATED_BLOCKS`` whole blocks of an
    earlier prompt (as many as it has) and runs past them, so that a hit longer than the one
    block the head drops is there to be found.  0: the admission follows ``shared-prefixes``."""
    return EAGLE_REPEATED_BLOCKS if drops_hit_block and EAGLE_PREFIX_HITS.on else 0


# ------------------------------------------------------------------------------ token budgets

# What a decode-relative budget is, by its relation code (``decode_relative_budget``); code 0
# and code 1, and any code with the rule off, keep the budget drawn before.  Two codes of seven
# and not half: hypothesis draws a code of 0 about a third of the time by itself, so the
# budget is kept in about half of the shapes (46 % of 795 measured; 67 % of 678 with five
# codes of ten).
DECODE_RELATIONS = ("drawn",) * 2 + ("below", "at", "few-above", "lookahead", "blocks-above")


def decode_relative_budget(
    relation: int, extra: int, drawn: int, *, num_spec_tokens: int, lookahead: int, block_size: int, max_model_len: int
) -> int:
    """Rule ``decode-relative`` (scheduler shapes): a chunked token budget by its relation to
    one decode step, D = 1 + ``num_spec_tokens`` tokens scheduled, and L = ``lookahead`` slots
    more allocated (an EAGLE head's, ``num_spec_tokens``; 0 for ngram drafts), from a
    ``relation`` code (an index into ``DECODE_RELATIONS``) and a small ``extra`` (1..2):
    ``drawn`` (about half of the draws) keeps the budget drawn uniformly below the context; ``below``
    D - 1 (a decode step's drafts do not all fit); ``at`` D; ``few-above`` D + ``extra``;
    ``lookahead`` D + L + ``extra`` - 1; ``blocks-above`` D + L + ``extra`` blocks.  A budget
    near one decode step is where a request's step outgrows an admission cap whose in-flight
    share is the budget (FINDINGS C3: 3 EAGLE drafts and a budget of 4-8) or where drafts are
    cut (C6: 3 ngram drafts, a budget of 2); drawn uniformly in [B, ``max_model_len``), 4-8
    of up to 127 is rare.  Every value is a chunked budget vLLM accepts: at least the block
    size (the uniform draw's floor), below ``max_model_len``, and above the lookahead slots --
    a drawn budget of at most ``num_lookahead_tokens``, which vLLM refuses (0.33.0
    config/vllm.py:2371-2377: the example was rejected), is raised to one more.  The code is
    drawn after the shape, so shrinking it to 0 leaves the budget drawn before (so raised).
    Switched off: the drawn budget, as it is."""
    if not DECODE_RELATIVE.on:
        return drawn
    kind = DECODE_RELATIONS[relation % len(DECODE_RELATIONS)]
    decode = 1 + num_spec_tokens
    budget = {
        "drawn": drawn,
        "below": decode - 1,
        "at": decode,
        "few-above": decode + extra,
        "lookahead": decode + lookahead + extra - 1,
        "blocks-above": decode + lookahead + extra * block_size,
    }[kind]
    return min(max(budget, block_size, lookahead + 1), max_model_len - 1)


# ------------------------------------------------------------------------------ lone requests

LONE_CODE = 224  # a code drawn in 0..255 at least this (one in eight) makes the example lone


def lone_request(code: int) -> bool:
    """Rule ``lone-requests`` (scheduler shapes): vLLM refuses to start with a pool smaller than
    one request of ``max_model_len`` needs (``check_enough_kv_cache_memory``, 0.33.0
    vllm/v1/core/kv_cache_planning.py:151; adapters/v1_scheduler.py's ``sizing``); in a pool at
    that minimum, a ``code`` of at least ``LONE_CODE`` (one example in eight) makes the example
    test that promise: one request only, never aborted, its prompt and ``max_tokens`` filling the
    context.  Most examples admit several requests, and a request alone in the pool is what
    FINDINGS C3's stall needs (it is preempted with no other request holding a block).  The
    code is drawn after the shape, at the startup minimum only; shrinking it leaves the ordinary
    example."""
    return LONE_REQUESTS.on and code >= LONE_CODE


__all__ = [
    "ALPHABET",
    "DECODE_RELATIONS",
    "EAGLE_REPEATED_BLOCKS",
    "LONE_CODE",
    "RULES",
    "SPECIAL_TOKENS_IDS",
    "Rule",
    "aborts_swapped",
    "block_relative",
    "decode_relative_budget",
    "eagle_caches",
    "eagle_repeated_blocks",
    "identifiers",
    "lone_request",
    "moves_media",
    "pool_blocks",
    "prompt_length",
    "repeats_prefix",
    "spare_blocks",
    "token",
]
