"""The target guard on a real vLLM block manager: vLLM's own ``free`` made to spin (patched in this
process) ends as a ``hung`` report with the trace up to the operation, and a crash raised inside
vLLM's code is recorded on its step with vLLM's file:line, and replays as that crash."""

from __future__ import annotations

import json

from kvspec.cli.main import main

from .conftest import requires_vllm

CHECK = ["check", "--impl", "legacy-v2", "--profile", "ci", "--no-known", "--examples", "20", "--max-violations", "1"]


def _report(out_dir):
    reports = sorted(out_dir.rglob("report.json"))
    assert reports, f"no report under {out_dir}"
    return reports[0], json.loads(reports[0].read_text())


@requires_vllm("0.6.3", "0.6.3")
def test_a_hang_in_vllm_is_reported_as_hung(monkeypatch, tmp_path, capsys):
    from vllm.core.block_manager_v2 import BlockSpaceManagerV2

    def spin(self, seq):
        while seq is not None:
            pass

    monkeypatch.setattr(BlockSpaceManagerV2, "free", spin)
    code = main([*CHECK, "--op-timeout", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "the target hung" in out and "target hung in free after 1 s" in out
    _, report = _report(tmp_path)
    assert report["outcome"] == "hung" and report["trace"][-1]["op"] in ("free", "preempt")
    assert report["crash"]["type"] == "TargetHung"


@requires_vllm("0.6.3", "0.6.3")
def test_a_crash_inside_vllm_is_located_in_vllm_and_replays(monkeypatch, tmp_path, capsys):
    from vllm.core.block_manager_v2 import BlockSpaceManagerV2

    def forget_then_free(self, seq):
        self.block_tables.pop(seq.seq_id, None)
        self.get_block_table(seq)  # vLLM's own lookup of the table it no longer has: KeyError

    monkeypatch.setattr(BlockSpaceManagerV2, "free", forget_then_free)
    code = main([*CHECK, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1 and "the target crashed" in out
    path, report = _report(tmp_path)
    crash = report["trace"][-1]["crash"]
    assert crash["type"] == "KeyError"
    assert crash["location"].startswith("vllm/core/block_manager_v2.py:")
    assert main(["replay", str(path)]) == 1
    assert "the recorded crash reproduces" in capsys.readouterr().out
