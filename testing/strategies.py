"""Hypothesis strategies for configurations and prompts.

Windows are drawn by their relation to the block size (W < B, W = B, W mod B in {0, 1},
anything), because that relation is where window arithmetic breaks.  Prompts are drawn
from earlier prompts (cut and extended) so that prefix caching and sharing get exercised.
"""

from __future__ import annotations

from collections.abc import Sequence

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


@st.composite
def prompts(
    draw, earlier: Sequence[tuple[int, ...]], block_size: int, max_len: int
) -> tuple[int, ...]:
    fresh = st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=max_len).map(tuple)
    if not earlier:
        return draw(fresh)
    base = draw(st.sampled_from(list(earlier)))
    # Cut at a block boundary most of the time: that is where cache hits happen.
    cut = draw(
        st.one_of(
            st.integers(0, len(base) // block_size).map(lambda n: n * block_size),
            st.integers(0, len(base)),
        )
    )
    tail = draw(st.lists(st.integers(0, ALPHABET - 1), max_size=max_len))
    prompt = (base[:cut] + tuple(tail))[:max_len]
    return prompt or draw(fresh)
