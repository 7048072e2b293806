"""Hypothesis strategies for configurations and prompts.

Windows are drawn by their relation to the block size (W < B, W = B, W mod B in {0, 1},
anything), because that relation is where window arithmetic breaks.  Prompts are drawn
from earlier prompts (cut and extended) so that prefix caching and sharing get exercised.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st
from kvspec.spec.config import Config

ALPHABET = 4  # few distinct tokens: shared prefixes and equal blocks happen often


BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 8, 16])
BOTH = st.booleans()


@st.composite
def windows(draw, block_size: int) -> int | None:
    B = block_size
    options = [
        st.none(),
        st.just(B),
        st.integers(1, 4).map(lambda m: m * B),
        st.integers(1, 4).map(lambda m: m * B + 1),
        st.integers(1, 4 * B + 3),
    ]
    if B > 1:
        options.append(st.integers(1, B - 1))
    return draw(st.one_of(options))


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
) -> Config:
    B = draw(block_sizes)
    return Config(
        block_size=B,
        num_blocks=draw(st.integers(1, max_blocks)),
        num_cpu_blocks=draw(st.integers(0, 8)) if swap else 0,
        sliding_window=draw(windows(B)) if sliding_window else None,
        prefix_caching=draw(prefix_caching),
        max_lookahead=draw(st.integers(0, max_lookahead)),
    )


# A prompt, like a scheduler iteration's choices, is one byte string: a single hypothesis
# draw however long the prompt (per-token draws were most of the oracle's time), and bytes
# shrink towards 0 one position at a time -- a fresh prompt, no shared prefix, token 0.
PROMPT_HEADER = 2  # source byte, cut byte; the rest are the tail's tokens


def as_tokens(raw: bytes) -> tuple[int, ...]:
    return tuple(b % ALPHABET for b in raw)


@functools.cache
def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


@functools.cache
def prompt_bytes(max_len: int) -> st.SearchStrategy[bytes]:
    return st.binary(min_size=PROMPT_HEADER, max_size=PROMPT_HEADER + max_len)


def prompt_from_bytes(
    raw: bytes, earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    """Decode a prompt: usually an earlier prompt cut and extended (so that prefixes are
    shared), cut at a block boundary half of the time (that is where cache hits happen)."""
    source, cut_code = raw[0], raw[1]
    tail = as_tokens(raw[PROMPT_HEADER:])
    if not earlier or source % 4 == 0:
        return tail[:max_len] or (0,)
    base = earlier[(source // 4) % len(earlier)]
    if cut_code % 2 == 0:
        cut = (cut_code // 2) % (len(base) // block_size + 1) * block_size
    else:
        cut = (cut_code // 2) % (len(base) + 1)
    return (base[:cut] + tail)[:max_len] or base[:max_len]


def draw_prompt(
    draw: Callable[..., Any], earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    """``draw`` is hypothesis' draw function (the machine's ``data.draw``)."""
    raw = draw(prompt_bytes(max_len), label="prompt (source, cut, tokens...)")
    return prompt_from_bytes(raw, earlier, block_size, max_len)


@st.composite
def prompts(
    draw, earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    return prompt_from_bytes(draw(prompt_bytes(max_len)), earlier, block_size, max_len)
