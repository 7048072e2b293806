"""kvspec fuzz --machine scheduler: the scheduler machine's campaign over one example database,
on kvspec's own schedulers (no vLLM).  A broken scheduler is found, reported with its folder
and replayed; the reference scheduler holds; a campaign that ran nothing claims nothing."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvspec.cli.common import EXIT_FOUND, EXIT_OK, EXIT_USAGE
from kvspec.cli.fuzz import Campaign
from kvspec.cli.fuzz_scheduler import SCHEDULER_SEARCH, _summarise

# Found in a few hundred examples of the production shapes: every hybrid shape reaches it.
VARIANT = "broken-scheduler:aliased-group-tables"


def _kvspec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvspec.cli", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=600)


def test_a_broken_scheduler_is_found_reported_and_replayed(tmp_path):
    out = tmp_path / "campaign"
    run = _kvspec("fuzz", "--machine", "scheduler", "--impl", VARIANT, "--workers", "2",
                  "--time-budget", "240", "--out", str(out), cwd=tmp_path)
    assert run.returncode == EXIT_FOUND, run.stdout + run.stderr
    assert "new:" in run.stdout and "stopped at the first new verdict" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "found" and summary["machine"] == "scheduler"
    assert summary["examples"] > 0 and summary["workers"] == 2
    campaign = Campaign.from_json(json.loads((out / "campaign.json").read_text()))
    assert campaign.search == SCHEDULER_SEARCH and campaign.impl == VARIANT
    assert summary["key"] == campaign.key().decode()
    # Deduplicated: one entry per identity, a new bug (no known finding names kvspec's variants).
    identities = [v["identity"] for v in summary["verdicts"]]
    assert identities and len(identities) == len(set(identities))
    first = summary["verdicts"][0]
    assert first["known_finding"] is None and first["kind"] == "invariant"
    report = json.loads(Path(first["report"]).read_text())
    assert report["machine"] == "scheduler" and report["implementation_name"] == VARIANT
    assert report["shape"] is not None and report["trace"] and report["violations"]
    assert (Path(first["report"]).parent / "trace.txt").exists()
    assert any((out / "db").iterdir()), "hypothesis stored nothing in the shared database"

    replayed = _kvspec("replay", first["report"], cwd=tmp_path)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert "reproduces" in replayed.stdout
    assert VARIANT in replayed.stderr


def test_a_seeded_search_still_stores_its_failures_in_the_campaign_database():
    """A campaign's rounds run the ``dev`` profile with a drawn seed; hypothesis' ``seed``
    switches the example database off, so the search puts it back: the failure a round finds
    is in the shared database for the other workers (under ``ci`` no seed is applied, so the
    campaign test above cannot see this)."""
    from hypothesis.database import InMemoryExampleDatabase
    from kvspec.cli.shapes import run_scheduler_search
    from kvspec.reference.broken_scheduler import BROKEN_SCHEDULERS
    from kvspec.testing.scheduler.machine import shapes

    database = InMemoryExampleDatabase()
    variant = BROKEN_SCHEDULERS[VARIANT.split(":", 1)[1]]
    run = run_scheduler_search(variant.cls, shape_strategy=shapes(), profile="dev", examples=300, steps=None,
                               seed=7, focus=None, database=database, database_key=b"campaign")
    assert run.summary.status == "violated", run.summary.status
    # The rounds after the first replay it and step past it (reported), so hypothesis may
    # move it to the key's secondary entries, which a campaign's reuse phase replays too.
    stored = [*database.fetch(b"campaign"), *database.fetch(b"campaign.secondary")]
    assert stored, "the seeded search stored nothing"


def test_the_reference_scheduler_holds_for_the_budget(tmp_path):
    out = tmp_path / "campaign"
    run = _kvspec("fuzz", "--machine", "scheduler", "--impl", "reference-scheduler", "--workers", "1",
                  "--time-budget", "8", "--out", str(out), cwd=tmp_path)
    assert run.returncode == EXIT_OK, run.stdout + run.stderr
    assert "no verdict" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["outcome"] == "no failure" and summary["verdicts"] == []
    assert summary["examples"] > 0 and sum(ex for ex, _ in summary["per_shape"].values()) >= summary["examples"]
    assert summary["per_worker"]["0"]["budget"]["examples_started"] > 0


def test_a_campaign_draws_every_production_shape_the_kv_connectors_included():
    """The campaign's shapes (``swarm_shapes`` over what the target offers, as its workers
    build them) include the KV-connector ones: its campaigns once ran none.  Searched for by a
    derandomized ``find``, not by a timed campaign, whose few examples under load prove nothing."""
    from hypothesis import find, settings
    from kvspec.testing.implementations import lookup_scheduler
    from kvspec.testing.scheduler.machine import kv_connectors_of, multimodal_of, retention_offer_of, swarm_shapes

    factory = lookup_scheduler("reference-scheduler").factory
    connectors = kv_connectors_of(factory)
    assert connectors
    strategy = swarm_shapes(retention_offer_of(factory), connectors, multimodal_of(factory))
    budget = settings(derandomize=True, database=None, max_examples=2000)
    assert find(strategy, lambda shape: shape.kv_connector is not None, settings=budget).kv_connector in connectors


@pytest.mark.parametrize("failed", [False, True])
def test_a_campaign_that_ran_nothing_claims_nothing(tmp_path, failed):
    campaign = Campaign("reference-scheduler", None, {}, None, SCHEDULER_SEARCH, 40, str(tmp_path / "db"))
    failures = [{"worker": 0, "error_type": "RuntimeError", "message": "could not build"}] if failed else []
    latest = {0: {"worker": 0, "kind": "done", "examples": 0, "operations": 0, "seconds": 0.1}}
    code = _summarise(argparse.Namespace(workers=1), campaign, tmp_path, latest, {}, failures, 0.2, 5.0,
                      "the time limit", "")
    assert code == (EXIT_USAGE if failed else EXIT_FOUND)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == ("worker error" if failed else "nothing ran")


def test_scheduler_campaign_options_are_checked(tmp_path):
    bad = _kvspec("fuzz", "--machine", "scheduler", "--impl", "reference", "--time-budget", "1", cwd=tmp_path)
    assert bad.returncode == EXIT_USAGE and "is not one" in bad.stderr
    until = _kvspec("fuzz", "--machine", "scheduler", "--impl", "reference-scheduler", "--until", "C3",
                    "--time-budget", "1", cwd=tmp_path)
    assert until.returncode == EXIT_USAGE and "not a known finding" in until.stderr
    block = _kvspec("fuzz", "--impl", "reference", "--until", "C3", "--time-budget", "1", cwd=tmp_path)
    assert block.returncode == EXIT_USAGE and "--machine scheduler" in block.stderr


def test_a_campaign_search_hunts_the_known_findings_and_steps_past_what_it_reported():
    """``search_rounds(hunt=..., reported=...)``, as each worker's search calls it: a hunted
    known finding is not stepped past while exploring (the round that meets it reports it, by
    its id, and ``on_found`` hears of it at once); what earlier searches reported is a repeat,
    never reported or searched for again."""
    from types import SimpleNamespace

    from kvspec.cli.search import search_rounds
    from kvspec.testing.known import Fingerprint, KnownFinding

    known = [KnownFinding(i, i, ("progress",), ("step",)) for i in ("A", "B")]
    rounds: list[Any] = []

    def run_round(sieve, _mask, _tag):
        rounds.append(sieve)
        if len(rounds) == 1:  # the first round meets A (what Sieve.__call__ records)
            sieve.target, sieve.last = "A", Fingerprint("progress", "step")
            return SimpleNamespace(status="violated")
        sieve.fired["B"] += 1  # B, reported before, met again: stepped past
        return SimpleNamespace(status="holds")

    heard: list[Any] = []
    search = search_rounds(run_round, known, reported=["B"], hunt=["A", "B"], on_found=heard.append)
    assert rounds[0].stepped == frozenset() and "B" in rounds[0].reported
    assert [f.known.id for f in search.found] == ["A"] and heard == search.found
    assert {"A", "B"} <= rounds[1].reported
    assert len(rounds) == 2 and not search.missed  # B is not searched for again


def _usage_counts_a_null_block():
    """kvspec's reference scheduler reporting its usage as vLLM 0.9.1/0.10.1.1's BlockPool does
    (V1-e: the null block counted in use, ``(used + 1) / (N + 1)``): ``conservation`` fails at
    every state, from construction on, and the state is otherwise sound."""
    import attrs
    from kvspec.reference.scheduler import ReferenceScheduler

    class NullBlockUsage(ReferenceScheduler):
        def observe(self):
            state = super().observe()
            pool = state.pool
            used = len(pool.ids) - len(pool.free) - len(pool.evictable)
            return attrs.evolve(state, pool=attrs.evolve(pool, usage=(used + 1) / (len(pool.ids) + 1)))

    return NullBlockUsage


def test_a_campaign_searches_behind_a_go_on_finding_it_reported():
    """A go_on known finding that shows at every state (V1-e/scheduler on 0.9.1 and 0.10.1.1) is
    hunted, reported once, and then gone on past as ``kvspec check`` goes on past it: the
    campaign's later rounds and searches run operations.  Discarded as a repeat, every example
    ended at its first check and a 60 s campaign on 0.9.1 ran "131 examples, 0 operations"."""
    from kvspec.cli.shapes import run_scheduler_search
    from kvspec.testing.known import KnownFinding
    from kvspec.testing.scheduler.machine import shapes

    usage = KnownFinding("U", "usage counts the null block", ("conservation",),
                         ("teardown", "arrive", "abort", "step", "drain"), kind=("wrong-usage",), go_on=True)
    factory = _usage_counts_a_null_block()
    budget = {"shape_strategy": shapes(), "profile": "dev", "examples": 20, "steps": None, "focus": None}
    heard: list[Any] = []
    # The campaign's first search: the round that meets U reports it (shrunk: no operation);
    # the rounds after it go on past it.
    first = run_scheduler_search(factory, known=[usage], hunt=["U"], on_found=heard.append, seed=3, **budget)
    assert [f.identity for f in first.search.found] == ["U"] == [f.identity for f in heard]
    assert len(first.search.rounds) >= 2 and first.search.rounds[-1].operations > 0
    assert not first.search.missed and first.search.stopped is None
    # A later search of the same worker: U reported before, searched behind.
    later = run_scheduler_search(factory, known=[usage], hunt=["U"], reported=["U"], seed=4, **budget)
    assert later.search.found == [] and later.summary.status == "holds", later.summary.status
    assert later.summary.operations > later.summary.examples > 0
    assert sum(later.summary.counts.operations.values()) > 0


def test_a_campaign_that_ran_no_operation_says_so(tmp_path):
    """Examples that all ended before their first operation are no search: never a clean run
    ("nothing ran", exit 1), and beside a verdict the summary says so too."""
    from kvspec.cli.common import out

    campaign = Campaign("reference-scheduler", None, {}, None, SCHEDULER_SEARCH, 40, str(tmp_path / "db"))
    latest = {0: {"worker": 0, "kind": "done", "examples": 131, "operations": 0, "seconds": 60.0}}
    with out.capture() as captured:
        code = _summarise(argparse.Namespace(workers=1), campaign, tmp_path, latest, {}, [], 60.0, 60.0,
                          "the time limit", "")
    assert code == EXIT_FOUND and "no operation ran" in captured.get()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outcome"] == "nothing ran" and summary["nothing_ran"]
    verdict = {"identity": "V1-e/scheduler", "fingerprint": "conservation in teardown",
               "known_finding": "V1-e/scheduler", "kind": "invariant", "worker": 0, "seconds": 50.0,
               "campaign_examples_then": 3, "shape": None, "report": "r.json", "also": []}
    with out.capture() as captured:
        code = _summarise(argparse.Namespace(workers=1), campaign, tmp_path, latest, {"V1-e/scheduler": verdict},
                          [], 60.0, 60.0, "the time limit", "")
    assert code == EXIT_FOUND and "no operation ran" in captured.get()
    assert json.loads((tmp_path / "summary.json").read_text())["nothing_ran"]


def test_a_swarm_configuration_draws_only_the_values_it_keeps():
    """testing/scheduler/swarm.py: a shape drawn under a swarm configuration takes only the
    values each feature keeps (here C3's corner: a window group, EAGLE drafts, the startup
    minimum, a chunking budget, no connector, no images); a feature it keeps whole is drawn."""
    from hypothesis import HealthCheck, given, settings
    from kvspec.spec.groups import KV_CONNECTORS
    from kvspec.testing.scheduler.machine import shapes
    from kvspec.testing.scheduler.swarm import DIMENSIONS, Swarm

    corner = Swarm({**DIMENSIONS, "groups": ("window",), "drafts": ("eagle",), "pool": ("startup-min",),
                    "budget": ("chunked",), "connector": ("none",), "images": ("none",)})
    assert corner.describe().startswith("groups=window drafts=eagle pool=startup-min budget=chunked")
    seen = set()

    @settings(max_examples=200, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(shapes(connectors=KV_CONNECTORS, multimodal=True, swarm=corner))
    def check(shape):
        assert shape.sliding_window is not None and not shape.mamba and shape.attention_chunk_size is None
        assert shape.eagle and shape.num_spec_tokens > 0 and shape.extra_blocks == 0
        assert shape.max_num_batched_tokens < shape.max_model_len
        assert shape.kv_connector is None and not shape.multimodal
        seen.add((shape.prefix_caching, shape.async_scheduling))

    check()
    assert len(seen) == 4  # prefix caching and async, kept whole, take both values


def test_swarm_shapes_reach_every_production_shape():
    """The campaign's shapes (``swarm_shapes``: each example draws its swarm configuration) reach
    every shape tag ``kvspec check``'s do, and the swarm shrinks away (every value kept)."""
    from hypothesis import find, settings
    from kvspec.spec.groups import KV_CONNECTORS, SHAPE_TAGS
    from kvspec.testing.scheduler.machine import swarm_shapes
    from kvspec.testing.scheduler.swarm import DIMENSIONS, swarms

    offered = swarm_shapes(connectors=KV_CONNECTORS, multimodal=True)
    for tag in SHAPE_TAGS:
        find(offered, lambda s, tag=tag: tag in s.tags(), settings=settings(max_examples=2000, database=None))
    assert find(swarms(), lambda _s: True).kept == DIMENSIONS


def test_a_search_that_does_not_replay_leaves_the_database_as_it_was():
    """``run_shapes(replay=False)``: a campaign's searches once their worker has reported leave
    the database unreplayed.  Replayed, an entry that does not fail (a reported finding, stepped
    past) is deleted by hypothesis, and re-run at the start of every search."""
    from hypothesis.database import InMemoryExampleDatabase
    from kvspec.cli.shapes import run_shapes
    from kvspec.reference.scheduler import ReferenceScheduler
    from kvspec.testing.scheduler.machine import shapes

    stored = b"\x00\x01\x02"  # not a failing example of this test
    for replay in (False, True):
        database = InMemoryExampleDatabase()
        database.save(b"campaign", stored)
        run = run_shapes(ReferenceScheduler, profile="dev", examples=3, steps=3, seed=1, focus=None,
                         shape_strategy=shapes(), database=database, database_key=b"campaign", replay=replay)
        assert run.status == "holds", run.status
        assert (list(database.fetch(b"campaign")) == [stored]) is not replay


def test_the_workers_read_what_the_campaign_reported(tmp_path):
    """Each worker steps past the known findings another worker reported (``REPORTED_FILE``,
    written by the coordinator) from its next search on, instead of shrinking them again."""
    from kvspec.cli.fuzz_scheduler import REPORTED_FILE, reported_by_campaign

    assert reported_by_campaign(tmp_path) == []
    (tmp_path / REPORTED_FILE).write_text("C5\nC6\n")
    assert reported_by_campaign(tmp_path) == ["C5", "C6"]


def test_a_worker_stops_shrinking_a_finding_another_worker_reported(tmp_path):
    """Two workers that meet the same known finding both shrank it to its end (a campaign at a
    load of 8 spent 555 of its 987 examples so, C5's); a worker's round now ends at its next
    example once the coordinator has reported the finding it shrinks, and its next search
    steps past it.  Not a deadline: the worker goes on."""
    import time as clock
    from types import SimpleNamespace

    from kvspec.cli.budget import BudgetSpent
    from kvspec.cli.fuzz_scheduler import REPORTED_FILE, CampaignPart

    part = CampaignPart("worker 1", 600.0, clock.monotonic() + 600.0, folder=tmp_path)
    part.watch(SimpleNamespace(target="C5"))
    part.start_example()  # shrinking C5, reported by nobody yet
    (tmp_path / REPORTED_FILE).write_text("C6\n")
    part.start_example()
    (tmp_path / REPORTED_FILE).write_text("C6\nC5\n")
    with pytest.raises(BudgetSpent):
        part.start_example()
    assert not part.cut and part.examples == 2
    part.watch(SimpleNamespace(target=None))  # the next search's round: nothing shrinking
    part.start_example()
