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


# Token runs are drawn as one byte string each: a single hypothesis draw however long the
# run (per-token draws were most of the oracle's time), and bytes shrink towards token 0
# one position at a time.
def token_runs(min_size: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    return _token_runs(min_size, max_size)


@functools.cache
def _token_runs(min_size: int, max_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    return st.binary(min_size=min_size, max_size=max_size).map(as_tokens)


def as_tokens(raw: bytes) -> tuple[int, ...]:
    return tuple(b % ALPHABET for b in raw)


@functools.cache
def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


@st.composite
def prompts(
    draw, earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    return draw_prompt(lambda strategy, label=None: draw(strategy), earlier, block_size, max_len)


def draw_prompt(
    draw: Callable[..., Any], earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    """A prompt, usually an earlier one cut and extended (so that prefixes are shared).
    ``draw`` is hypothesis' draw function; the machine calls this without building a
    strategy per admission."""
    if not earlier or draw(integers(0, 3), label="fresh?") == 0:
        return draw(token_runs(1, max_len), label="prompt")
    base = earlier[draw(integers(0, len(earlier) - 1), label="base")]
    # Cut at a block boundary most of the time: that is where cache hits happen.
    if draw(integers(0, 1), label="cut inside a block?") == 0:
        cut = draw(integers(0, len(base) // block_size), label="cut (blocks)") * block_size
    else:
        cut = draw(integers(0, len(base)), label="cut")
    tail = draw(token_runs(0, max_len), label="tail")
    prompt = (base[:cut] + tail)[:max_len]
    return prompt or draw(token_runs(1, max_len), label="prompt")
