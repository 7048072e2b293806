"""A legacy golden test whose difference is the prefix-cache hit rate.

HEAD is 0.6.3 with the mutant ``num_incompleted_block_queries += 2`` of block/common.py:306
(its metric counts every lookup twice; the bench's mutant tree, bench/lockstep_mutation.py):
the lockstep reports a behaviour change in ``hit_rate`` at the second admission of the same
one-token prompt (B=1, 2 GPU blocks, prefix caching), where 0.6.3 reports 0.5 and the mutant
0.25.  The golden file written on BASE must pass there and fail on HEAD, tagged, at that
figure.  Needs the provisioned 0.6.3 venv; skips loudly without it.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import pytest
from kvspec.targets.provision import REPO
from kvspec.targets.registry import target

from .test_golden_legacy_answer import golden_on_both

RELEASE = target("0.6.3")
MUTANT = "vllm.core.block.common:836:CRP:0"  # common.py:306 CRP `1` -> `2` (bench/results/mutation.json)

pytestmark = [
    pytest.mark.target,
    pytest.mark.skipif(not RELEASE.is_provisioned(),
                       reason="vLLM 0.6.3 must be provisioned: run `kvspec provision 0.6.3`"),
]

WRITE = """
import sys
from kvspec.spec.config import Config
from kvspec.testing.blockmanager.driver import TraceStep
from kvspec.testing.artifacts.golden import write_golden

config = Config(block_size=1, num_blocks=2, num_cpu_blocks=0, sliding_window=None, prefix_caching=True,
                max_lookahead=0)
trace = [TraceStep("admit", {"seq": s, "tokens": [0], "num_new_tokens": 1, "next_token": 0}) for s in (0, 1)]
golden = write_golden("legacy-v2", config, trace, "hit_rate differs", 2)
open(sys.argv[1], "w").write(golden["text"])
"""


def test_a_differing_hit_rate_fails_tagged_on_head_and_passes_on_base(tmp_path):
    sys.path.insert(0, str(REPO))  # bench/ is not installed
    from bench.lockstep_mutation import mutant_tree

    (site,) = glob.glob(str(RELEASE.python.parent.parent / "lib" / "python*" / "site-packages"))
    tree = mutant_tree(Path(site), MUTANT, tmp_path / "head")
    out = golden_on_both(WRITE, tmp_path, RELEASE.python, RELEASE.python, head_path=str(tree))
    assert "Failed: [behaviour-change] hit_rate: expected 0.5 (BASE), observed 0.25" in out, out[-3000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
