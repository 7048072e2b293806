"""The configuration of one block manager: the named quantities every formula derives from."""

from __future__ import annotations

import attrs

from .errors import ConfigError


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class Config:
    """A block manager's configuration.

    block_size        B: tokens per block.
    num_blocks        N: blocks in the device (GPU) pool, not counting any null block.
    num_cpu_blocks    blocks in the swap (CPU) pool; 0 means swapping is off.
    sliding_window    W: a token at position p attends positions max(0, p-W+1) .. p;
                      None means full attention.
    prefix_caching    whether full blocks are shared through the prefix cache.
    max_lookahead     speculative slots the scheduler reserves past each step (vLLM's
                      num_lookahead_slots / num_spec_tokens: a constant of the run).
    """

    block_size: int
    num_blocks: int
    num_cpu_blocks: int = 0
    sliding_window: int | None = None
    prefix_caching: bool = False
    max_lookahead: int = 0

    def __attrs_post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks (the pool must hold at least one block)", self.num_blocks)
        if not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ConfigError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks!r}")
        if self.sliding_window is not None:
            _positive("sliding_window", self.sliding_window)
        if not isinstance(self.max_lookahead, int) or self.max_lookahead < 0:
            raise ConfigError(f"max_lookahead must be >= 0, got {self.max_lookahead!r}")

    def describe(self) -> str:
        window = "full attention" if self.sliding_window is None else f"W={self.sliding_window}"
        cache = "prefix caching" if self.prefix_caching else "no prefix caching"
        return (
            f"B={self.block_size} N={self.num_blocks} cpu={self.num_cpu_blocks} "
            f"{window} {cache} lookahead<={self.max_lookahead}"
        )
