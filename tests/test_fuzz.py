"""kvspec fuzz: two workers on one example database; the failure a worker stores replays in
plain pytest (from the database) and in kvspec replay (from the report)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from kvspec.cli.fuzz import Campaign

VARIANT = "broken:leak-on-free"  # found within a few examples


def _kvspec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=600)


def _pytest(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", str(path)], cwd=path.parent, text=True,
                          capture_output=True, timeout=600)


def test_two_workers_share_one_database_and_the_stored_failure_replays(tmp_path):
    out = tmp_path / "campaign"
    run = _kvspec("fuzz", "--impl", VARIANT, "--workers", "2", "--minutes", "2",
                  "--out", str(out), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "found a failure" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["examples"] > 0
    assert any((out / "db").iterdir()), "hypothesis stored nothing in the shared database"
    campaign = Campaign.from_json(json.loads((out / "campaign.json").read_text()))
    assert summary["key"] == campaign.key().decode()

    replayed = _pytest(out / "test_fuzz_replay.py")
    assert replayed.returncode == 1, replayed.stdout
    assert "SpecViolation" in replayed.stdout

    report = _kvspec("replay", str(out / "report.json"), cwd=tmp_path)
    assert report.returncode == 1, report.stdout + report.stderr
    assert "reproduces" in report.stdout

    # The pytest file runs only what the database holds: without it, nothing fails.
    shutil.rmtree(out / "db")
    fresh = _pytest(out / "test_fuzz_replay.py")
    assert fresh.returncode == 0, fresh.stdout


def test_a_campaign_key_names_what_is_checked_not_where_it_is_stored():
    a = Campaign("v1", "0.33.0", {}, None, "default", 40, "/tmp/a")
    assert a.key() == Campaign("v1", "0.33.0", {}, None, "default", 40, "redis://x").key()
    assert a.key() != Campaign("v1", "0.33.0", {}, None, "swarm", 40, "/tmp/a").key()
    assert a.key() != Campaign("v1", "0.6.3", {}, None, "default", 40, "/tmp/a").key()


def test_a_hanging_target_ends_the_campaign_as_kvspec_check_reports_it(tmp_path):
    """The guard wraps every worker: a hang is outcome ``hung`` with the trace up to the call,
    the limits in the report, exit code 1, and ``kvspec replay`` (same limits) hangs again."""
    out = tmp_path / "campaign"
    run = _kvspec("fuzz", "--impl", "broken:hang-in-free", "--workers", "1", "--minutes", "1",
                  "--op-timeout", "0.3", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "the target hung" in run.stdout and "target hung in free after 0.3 s" in run.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["outcome"] == "hung"
    assert report["trace"][-1]["op"] == "free"
    assert report["trace"][-1]["crash"]["type"] == "TargetHung"
    assert report["crash"]["step"] == len(report["trace"])
    assert report["limits"] == {"op_timeout": 0.3, "memory_cap_gib": 4.0}
    replayed = _kvspec("replay", str(out / "report.json"), cwd=tmp_path)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "hung" in replayed.stdout
