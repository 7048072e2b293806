"""The prefix cache's domain arithmetic: which blocks' keys a multimodal feature reaches.

vLLM 0.33.0 puts ``("mm", identifier, offset - start)`` into the extra keys of every block
``[start, end)`` the feature ``[offset, offset + length)`` overlaps
(``_gen_mm_extra_hash_keys``, vllm/v1/core/kv_cache_utils.py:522-587: ``end > offset`` and not
``start >= offset + length``), and block hashes chain (``hash_block_tokens``, 707-737).  The
spec's key of the block ending at ``end`` carries the features with ``offset < end``
(``ExtraKeys.for_chain``, spec/prefix_hash.py).  The obligation: the two agree for every block
size, block index, placement and length -- so ``prefix-cache-isolation`` separates exactly the
blocks vLLM's hashes separate.
"""

from __future__ import annotations

import z3

from .core import Verdict, lemma, obligation

B, i, j, offset, length = z3.Ints("B i j offset length")


def _overlaps(block: z3.ArithRef) -> z3.BoolRef:
    """vLLM's per-block test: the block [block*B, (block+1)*B) overlaps the feature."""
    return z3.And((block + 1) * B > offset, z3.Not(block * B >= offset + length))


@obligation("prefix-cache-isolation/mm-chain-dependency")
def mm_chain_dependency(deep: bool) -> Verdict:
    """A multimodal feature reaches the chained key of block i (some block j <= i overlaps it)
    exactly when it starts before block i ends: offset < (i+1)*B, the spec's for_chain."""
    first = offset / B  # the block the feature starts in: vLLM's hash of it includes the feature

    def agree(spec_says: z3.BoolRef) -> z3.BoolRef:
        reached_by_j = z3.Implies(z3.And(j >= 0, j <= i, _overlaps(j)), spec_says)
        reaches = z3.Implies(spec_says, z3.And(first <= i, _overlaps(first)))
        return z3.And(reached_by_j, reaches)

    return lemma(
        [B >= 1, i >= 0, offset >= 0, length >= 1],
        agree(offset < (i + 1) * B),
        agree(offset <= (i + 1) * B),
        {"B": B, "i": i, "j": j, "offset": offset, "length": length},
        "unbounded: every B>=1, block index i>=0, offset>=0, length>=1",
        per_value=(B, 1024 if deep else 128),
    )
