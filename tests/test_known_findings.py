"""Multi-bug runs, fingerprints, known findings and the scheduler-feature pins of ``kvspec
check``, on kvspec's own reference (deliberately broken where a test needs a bug)."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from kvspec.cli.common import UsageError
from kvspec.cli.run import config_strategy, features_from, parse_overrides
from kvspec.cli.search import run_search
from kvspec.reference.broken import LeakOnFree
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.interface import Capability
from kvspec.spec.invariants import INVARIANTS
from kvspec.testing import Driver, KVCacheMachine, RunStats
from kvspec.testing.blockmanager.driver import OPS
from kvspec.testing.known import (
    CRASH,
    SHIPPED,
    Fingerprint,
    KnownFinding,
    KnownFindingsError,
    fingerprint,
    load_known,
)
from kvspec.testing.scheduler.replay import OPS as SCHEDULER_OPS

ROOT = Path(__file__).resolve().parent.parent


class CrashOnFork(LeakOnFree):
    """Two bugs at once: leaks on free (LeakOnFree) and raises on every fork."""

    name = "crash-on-fork"

    def fork(self, parent_id: int, child_id: int) -> None:
        raise KeyError(f"no such sequence {parent_id}")  # a target crash


def _search(**kw):
    return run_search(
        CrashOnFork,
        config_strategy("reference", {}),
        profile="ci",
        examples=40,
        steps=20,
        seed=None,
        focus=None,
        label="crash-on-fork",
        **kw,
    )


# The operation of a violation shown before any operation (known.py ``fingerprint``).
TEARDOWN = "teardown"


def test_shipped_known_findings_name_real_invariants_operations_and_findings():
    known = load_known([SHIPPED])
    findings = (ROOT / "FINDINGS.md").read_text()
    assert {"F1", "F2", "F4", "F6", "F12", "F3", "F9"} <= {k.id for k in known}
    for k in known:
        assert set(k.invariant) <= set(INVARIANTS) | {CRASH}, k
        if k.impl == ("v1-scheduler",):  # the scheduler machine's driver operations
            assert set(k.operation) <= {*SCHEDULER_OPS, TEARDOWN}, k
        else:  # the trace records readmit as admit
            assert set(k.operation) <= ({*OPS, TEARDOWN} - {"readmit"}), k
        # A FINDINGS.md entry: a row of a table, or a paragraph led by its id in bold; "ID/part"
        # fingerprints one form of the entry ID.
        entry = re.escape(k.id.split("/")[0])
        assert re.search(rf"^(\| {entry} \||\*\*{entry} )", findings, re.M), f"{k.id} is not in FINDINGS.md"
        assert k.impl and k.releases, f"{k.id}: a shipped fingerprint names its targets"


def test_a_known_findings_file_with_an_unknown_field_is_refused(tmp_path):
    bad = tmp_path / "known.toml"
    bad.write_text('[[finding]]\nid = "X"\ninvariant = "no-leak"\noperation = "free"\nwhere = "?"\n')
    with pytest.raises(KnownFindingsError, match="unknown field"):
        load_known([bad])
    bad.write_text('[[finding]]\nid = "X"\ninvariant = "no-leak"\n')
    with pytest.raises(KnownFindingsError, match="invariant and operation"):
        load_known([bad])


def test_a_crash_is_fingerprinted_by_operation_exception_and_site():
    driver = Driver(CrashOnFork(Config(block_size=1, num_blocks=4)))
    driver.admit(0, (0,), 1)
    with pytest.raises(KeyError) as caught:
        driver.fork(0, 1)
    fp = fingerprint(caught.value)
    assert (fp.invariant, fp.operation, fp.exception) == (CRASH, "fork", "KeyError")
    assert fp.location.endswith("test_known_findings.py:fork"), fp


def test_one_run_reports_each_distinct_violation_once_each_shrunk():
    search = _search(known=())
    prints = [f.fingerprint for f in search.found]
    assert len(prints) == len(set(prints)) >= 2, prints  # the run went on past the first
    crash = [f for f in search.found if f.fingerprint.invariant == CRASH]
    assert [f.fingerprint.operation for f in crash] == ["fork"], prints
    assert [s.op for s in crash[0].outcome.trace][-1] == "step" or len(crash[0].outcome.trace) <= 4
    assert any(f.fingerprint.invariant in ("no-leak", "refcount-exact") for f in search.found), prints
    for found in search.found:  # each one shrunk on its own, to its own fingerprint
        assert found.outcome.status in ("violated", "error")
        assert len(found.outcome.trace) <= 8, found.outcome.trace
    assert search.last.status == "holds"  # the last round ran its budget and found nothing new


def test_a_known_finding_is_stepped_past_counted_then_reported_alone():
    crash = KnownFinding("K1", "fork raises", invariant=(CRASH,), operation=("fork",))
    counted = _search(known=[crash], report_known=False)
    assert all(f.fingerprint.invariant != CRASH for f in counted.found), counted.found
    assert counted.fired["K1"] > 0
    reported = _search(known=[crash])
    labelled = [f for f in reported.found if f.known is not None]
    assert [(f.known.id, f.fingerprint) for f in labelled] == [
        ("K1", Fingerprint(CRASH, "fork", "KeyError", labelled[0].fingerprint.location))
    ]


def test_config_pins_every_scheduler_feature():
    pins = parse_overrides(["fork=off", "swap=off", "chunked_prefill=off", "window=on", "lookahead=on"])
    features = features_from(pins)
    assert (features.fork, features.swap, features.chunked_prefill) == (False, False, False)
    seen: list = []

    class Recording(ReferenceManager):
        def __init__(self, config: Config) -> None:
            super().__init__(config)
            seen.append(config)

        def admit(self, seq_id, tokens, num_new_tokens, extra=()):
            assert num_new_tokens >= len(tokens), "chunked prefill was pinned off"
            return super().admit(seq_id, tokens, num_new_tokens, extra)

    stats = RunStats()
    watched = set(INVARIANTS) - {"progress"}
    run_state_machine_as_test(
        # Not the progress drain at teardown: it schedules on its own, after the rules.
        lambda: KVCacheMachine(
            Recording, config_strategy("reference", pins), stats=stats, features=features, focus=watched
        ),
        settings=settings(max_examples=40, stateful_step_count=20, database=None, derandomize=True),
    )
    assert seen and all(c.sliding_window is not None and c.max_lookahead >= 1 for c in seen)
    assert not {"fork", "swap_out", "swap_in"} & set(stats.by_op), stats.by_op
    assert stats.by_op.get("admit", 0) > 0


def test_a_feature_pinned_on_that_the_target_lacks_is_refused():
    features = features_from(parse_overrides(["chunked_prefill=on", "swap=on"]))
    impl = ReferenceManager(Config(block_size=2, num_blocks=4, num_cpu_blocks=2))
    assert features.unsupported(impl) is None
    impl.capabilities = impl.capabilities - {Capability.CHUNKED_PREFILL}
    assert "chunked_prefill" in (features.unsupported(impl) or "")
    with pytest.raises(UsageError, match="num_cpu_blocks=0"):
        parse_overrides(["swap=on", "num_cpu_blocks=0"])


def test_a_violation_stepped_past_by_going_on_lets_the_example_continue():
    """CONTINUE: the example goes on after the violation (it is not ended, not discarded), and
    a policy that says False instead fails it, so the test can tell the two apart."""
    from hypothesis import strategies as st
    from kvspec.reference.broken import OffByOneWindow
    from kvspec.testing import SpecViolation
    from kvspec.testing.blockmanager.machine import CONTINUE
    from kvspec.testing.blockmanager.strategies import configs

    windowed = configs(block_sizes=st.just(1), max_blocks=8, require_window=True, swap=False)
    went_on: list[int] = []

    def go_on(error, driver):
        assert isinstance(error, SpecViolation) and error.violations[0].invariant == "window-bound"
        went_on.append(len(driver.trace))
        return CONTINUE

    def machine(policy):
        return lambda: KVCacheMachine(OffByOneWindow, windowed, focus={"window-bound"}, step_past=policy)

    budget = settings(max_examples=30, stateful_step_count=15, database=None, derandomize=True)
    run_state_machine_as_test(machine(go_on), settings=budget)
    assert went_on and max(went_on) > min(went_on)  # later operations of one run were checked too
    with pytest.raises(SpecViolation):
        run_state_machine_as_test(machine(lambda error, driver: False), settings=budget)


def test_step_past_known_goes_on_past_a_go_on_finding_and_discards_the_others():
    """``kvspec fuzz`` and the in-target tests step past known findings with ``step_past_known``:
    a go_on finding (one that shows at every state, like V1-e) is gone on past -- discarding
    would discard every example of its releases -- a finding without go_on is discarded, and a
    failure no finding names ends the example."""
    from kvspec.testing.blockmanager.machine import CONTINUE
    from kvspec.testing.known import step_past_known

    g = KnownFinding("G", "g", ("window-bound",), ("admit",), go_on=True)
    a = KnownFinding(
        "A", "a", ("admission-soundness",), ("admit",), kind=("ok-then-failed",), alongside=("no-leak",)
    )
    assert step_past_known([g, a], "reference", None) is not None
    from types import SimpleNamespace

    from kvspec.spec.invariants import Violation
    from kvspec.testing import SpecViolation
    from kvspec.testing.blockmanager.driver import TraceStep

    config = Config(block_size=2, num_blocks=4, sliding_window=2)
    driver = SimpleNamespace(config=config, trace=[TraceStep("admit", {"seq": 0}, "ok")])

    def judged(known, *violations):
        error = SpecViolation([Violation(*v) for v in violations], driver.trace)
        return step_past_known(known, "reference", None)(error, driver)

    assert judged([g, a], KNOWN_G) == CONTINUE
    assert judged([g, a], KNOWN_A) is True
    assert judged([g, a], KNOWN_G, KNOWN_A) is True  # not every one goes on: discarded
    assert judged([g, a], KNOWN_G, UNKNOWN) is False
    assert step_past_known([attrs.evolve(g, impl=("v1",))], "reference", None) is None


def test_masks_behind_are_the_smallest_feature_sets_no_fired_finding_survives():
    from kvspec.cli.search import masks_behind

    def k(ident, *requires, go_on=False):
        return KnownFinding(ident, ident, ("crash",), ("step",), requires=requires, go_on=go_on)

    known = [k("W", "window"), k("C", "prefix_caching"), k("CS", "prefix_caching", "swap"),
             k("LS", "lookahead", "swap"), k("G", "swap", go_on=True), k("ANY")]
    features = ("window", "prefix_caching", "lookahead", "swap")
    fired = {"W": 3, "C": 1, "CS": 2, "G": 9, "ANY": 4}
    # Going on drowns nothing (G), and a finding that needs no feature cannot be masked (ANY).
    assert masks_behind(known, fired, features) == [frozenset({"window", "prefix_caching"})]
    fired["LS"] = 1
    assert masks_behind(known, fired, features) == [
        frozenset({"window", "prefix_caching", "lookahead"}),
        frozenset({"window", "prefix_caching", "swap"}),
    ]
    # A feature the user pinned is not maskable: what needs it alone stays unmasked.
    assert masks_behind(known, {"W": 1, "C": 1}, ("prefix_caching",)) == [frozenset({"prefix_caching"})]
    assert masks_behind(known, {"G": 5, "ANY": 5}, features) == []


def test_a_finding_every_mask_drowns_gets_a_mask_that_keeps_its_features_on():
    """A finding that shares its feature with a frequent fired one (F1 and F6: the window) is
    unreachable under every hitting-set mask; while it has not fired it gets a mask of every
    other feature, and once it fired that mask is no longer asked for."""
    from kvspec.cli.search import masks_behind

    def k(ident, *requires, go_on=False):
        return KnownFinding(ident, ident, ("crash",), ("step",), requires=requires, go_on=go_on)

    features = ("window", "prefix_caching", "lookahead", "swap")
    known = [k("W1", "window"), k("W6", "window"), k("C", "prefix_caching"), k("G", "window", go_on=True),
             k("LS", "lookahead", "swap"), k("ALL", *features)]
    hitting = frozenset({"window", "prefix_caching"})
    keep_window = frozenset({"prefix_caching", "lookahead", "swap"})
    # W1 (and G, going on, while it has not fired) ask for the window kept on; ALL (every feature
    # on: the exploration itself) asks for nothing; LS is reachable under the hitting set.
    assert masks_behind(known, {"W6": 9, "C": 2}, features) == [hitting, keep_window]
    assert masks_behind(known, {"W6": 9, "C": 2, "W1": 1, "G": 4}, features) == [hitting]
    # Nothing fired: nothing drowns anything, no mask.
    assert masks_behind(known, {}, features) == []
    # A pinned feature is not maskable: the kept mask holds the maskable rest only.
    assert masks_behind(known, {"W6": 9}, ("window", "swap")) == [frozenset({"window"}), frozenset({"swap"})]


class CrashBehindWindowAndCaching(ReferenceManager):
    """Known bugs that fire on every windowed step and every cached admission, and behind them
    one that needs swap and lookahead slots with neither (what the known ones drown)."""

    name = "crash-behind-window-and-caching"

    def reserve(self, seq_id, num_new_tokens, lookahead=0):
        if self.config.sliding_window is not None:
            raise RuntimeError("windowed step")
        return super().reserve(seq_id, num_new_tokens, lookahead)

    def admit(self, seq_id, tokens, num_new_tokens, extra=()):
        if self.config.prefix_caching:
            raise KeyError("cached admission")
        return super().admit(seq_id, tokens, num_new_tokens, extra)

    def swap_out(self, seq_id):
        if self.config.max_lookahead > 0:
            raise IndexError("swap with lookahead")
        return super().swap_out(seq_id)


def test_the_rounds_go_on_behind_the_known_findings_under_a_feature_mask():
    from kvspec.cli.search import masking

    known = [
        KnownFinding("KW", "windowed step", (CRASH,), ("step",), requires=("window",)),
        KnownFinding("KC", "cached admission", (CRASH,), ("admit",), requires=("prefix_caching",)),
    ]
    masked, maskable = masking("reference", {})

    search = run_search(
        CrashBehindWindowAndCaching,
        config_strategy("reference", {}),
        profile="ci",
        examples=30,
        steps=12,
        seed=None,
        focus=None,
        label="behind",
        known=known,
        masked=masked,
        maskable=maskable,
    )
    assert search.masks[:2] == [frozenset(), frozenset({"window", "prefix_caching"})], search.masks
    assert search.fired_under == {"KW": frozenset(), "KC": frozenset()}
    masked_rounds = [o for o, m in zip(search.rounds, search.round_masks, strict=True) if m]
    assert masked_rounds and all(
        o.config is None or (o.config.sliding_window is None and not o.config.prefix_caching)
        for o in masked_rounds
    )
    (behind,) = [f for f in search.found if f.fingerprint.exception == "IndexError"]
    config = behind.outcome.config
    assert config.sliding_window is None and not config.prefix_caching and config.max_lookahead > 0
    assert sorted(f.known.id for f in search.found if f.known is not None) == ["KC", "KW"]
    # A pinned feature is never masked.
    assert masking("reference", parse_overrides(["window=on", "swap=off"]))[1] == ("prefix_caching", "lookahead")


def test_after_narrows_a_finding_to_traces_that_hold_the_operations():
    f8 = next(k for k in load_known([SHIPPED]) if k.id == "F8")
    windowed = Config(block_size=3, num_blocks=13, num_cpu_blocks=1, sliding_window=3)
    crash = Fingerprint(CRASH, "step", "AssertionError", "vllm/core/block/naive_block.py:_append_token_ids_no_cow")
    from kvspec.testing.known import Evidence

    said = Evidence(crash="AssertionError: ")
    assert f8.matches(crash, said, windowed, {"admit", "fork", "step"})
    assert not f8.matches(crash, said, windowed, {"admit", "step"})  # no fork: not F8
    assert not f8.matches(crash, said, Config(block_size=3, num_blocks=13), {"fork", "step"})


def test_a_known_finding_not_met_prints_the_budget_that_reaches_it():
    from collections import Counter

    from kvspec.cli.common import out
    from kvspec.cli.search import Search, print_known

    slow = KnownFinding("K9", "slow", ("refcount-exact",), ("admit",), reach="--impl x --examples 600")
    met = KnownFinding("K3", "met", ("immutability",), ("step",), reach="--examples 900")
    search = Search([], [], Counter({"K3": 2}), [slow, met])
    with out.capture() as captured:
        print_known(search)
    text = captured.get()
    assert "not met in this run: K9; its budget: kvspec check --impl x --examples 600" in text
    assert "not met in this run: K3" not in text


def _sieve_case():
    """A Sieve over two known findings of one ``admit`` (A stepped past by discarding, G by going
    on), and a way to show it an operation's violations."""
    from types import SimpleNamespace

    from kvspec.cli.search import Sieve
    from kvspec.spec.invariants import Violation
    from kvspec.testing import SpecViolation
    from kvspec.testing.blockmanager.driver import TraceStep

    a = KnownFinding(
        "A", "a", ("admission-soundness",), ("admit",), kind=("ok-then-failed",), alongside=("no-leak",)
    )
    g = KnownFinding("G", "g", ("window-bound",), ("admit",), go_on=True)
    config = Config(block_size=2, num_blocks=4, sliding_window=2)
    driver = SimpleNamespace(config=config, trace=[TraceStep("admit", {"seq": 0}, "ok")])
    sieve = Sieve(frozenset(), [a, g], frozenset({"A", "G"}))

    def show(*violations: tuple[str, ...]):
        error = SpecViolation([Violation(*v) for v in violations], driver.trace)
        return sieve(error, driver)  # type: ignore[arg-type]

    return sieve, show


KNOWN_A = ("admission-soundness", "the admission check answered OK, then the allocation failed", "ok-then-failed")
KNOWN_G = ("window-bound", "seq 0 holds 3 blocks but ... needs at most 2")
UNKNOWN = ("refcount-exact", "block 1 has refcount 2 with 1 holder(s)")


def test_a_known_finding_met_first_does_not_hide_another_violation_of_the_same_operation():
    """Every invariant an operation violated is judged on its own: a known one met first
    (stepped past by discarding, or by going on) and an unknown one beside it end the example on
    the unknown one, which becomes the round's failure."""
    from kvspec.testing.blockmanager.machine import CONTINUE

    for first in (KNOWN_A, KNOWN_G):
        sieve, show = _sieve_case()
        assert show(first, UNKNOWN) is False
        assert sieve.target == sieve.last == Fingerprint("refcount-exact", "admit")
    sieve, show = _sieve_case()
    assert show(KNOWN_G) == CONTINUE
    assert show(KNOWN_G, KNOWN_A) is True  # A leaves nothing to go on with: discarded
    assert show(KNOWN_A, KNOWN_G) is True
    assert sieve.fired == {"G": 3, "A": 2}  # both counted whichever came first
    assert sieve.target is None


def test_a_known_finding_is_found_again_when_another_known_one_comes_first():
    """Re-finding A (every other finding stepped past): an operation that shows G first and A
    beside it is A's failure, not discarded as G."""
    sieve, show = _sieve_case()
    sieve.stepped = frozenset({"G"})
    assert show(KNOWN_G, KNOWN_A) is False
    assert sieve.target == "A" and sieve.last == Fingerprint("admission-soundness", "admit")
    # While A shrinks, G alone is gone past as the search went past it; anything else is discarded.
    from kvspec.testing.blockmanager.machine import CONTINUE

    assert show(KNOWN_G) == CONTINUE
    assert show(UNKNOWN) is True
    assert show(UNKNOWN, KNOWN_A) is False


def test_what_a_finding_breaks_alongside_is_that_finding_only_beside_it():
    """A known finding's declared consequences in its own operation (A: a failed allocation
    not rolled back leaks) are stepped past with it; met alone, they are a new failure."""
    leak = ("no-leak", "no sequence is live, yet gpu blocks [0] are still in use")
    sieve, show = _sieve_case()
    assert show(KNOWN_A, leak) is True
    assert sieve.fired == {"A": 1} and sieve.target is None
    assert show(leak) is False
    assert sieve.target == Fingerprint("no-leak", "admit")
    sieve, show = _sieve_case()
    assert show(KNOWN_A, leak, UNKNOWN) is False  # what it does not declare still ends the example
    assert sieve.target == Fingerprint("refcount-exact", "admit")


def test_every_legacy_range_says_how_it_was_measured():
    """A legacy entry's releases are what `kvspec bisect` measured, or the entry says why they
    are where the finding was seen (bisect: the run, or the reason it could not be run)."""
    legacy = {"legacy-v1", "legacy-v2", "legacy-self-attn"}
    unmeasured = [k.id for k in load_known([SHIPPED]) if k.releases and set(k.impl) & legacy and not k.bisect]
    assert not unmeasured, f"no bisect note: {unmeasured}"


# A violation between two domains: (implementation, invariant, kind) of each machine's form.
ISOLATION = ("v1", "prefix-cache-isolation", "cross-domain-key")
COLLISION = ("v1-scheduler", "prefix-cache-consistency", "domain-collision")
LORA_SALT, MM_SALT = ("cache_salt", "lora"), ("cache_salt", "mm")


@pytest.mark.parametrize(
    "form, domains, version, label",
    [
        # The block manager: F-KV10 (an image identifier against a salt) 0.10.1.1-0.12.0 ...
        (ISOLATION, MM_SALT, "0.10.1.1", "F-KV10"),
        (ISOLATION, MM_SALT, "0.12.0", "F-KV10"),
        (ISOLATION, MM_SALT, "0.19.1", None),
        # ... F-KV9 (a LoRA name against a salt) 0.12.0-0.30.0: 0.12.0 has both.
        (ISOLATION, LORA_SALT, "0.10.2", None),
        (ISOLATION, LORA_SALT, "0.12.0", "F-KV9"),
        (ISOLATION, LORA_SALT, "0.30.0", "F-KV9"),
        (ISOLATION, LORA_SALT, "0.31.0", None),
        # An identifier against a LoRA name (0.12.0 only): ended by F-KV10's fix (0.19.1 tags items).
        (ISOLATION, ("lora", "mm"), "0.12.0", "F-KV10"),
        (ISOLATION, ("lora", "mm"), "0.19.1", None),
        (ISOLATION, ("cache_salt", "lora", "mm"), "0.12.0", "F-KV10"),  # e.g. lora a + image b, image a + salt b
        (ISOLATION, ("lora",), "0.12.0", None),
        # One identifier at two offsets in the block (0.9.1-0.12.0 key no offset; 0.19.1 does):
        # F-KV3, not F-KV10 (no two kinds confused), so a search for one does not step past the other.
        (ISOLATION, ("mm",), "0.9.1", "F-KV3"),
        (ISOLATION, ("mm",), "0.12.0", "F-KV3"),
        (ISOLATION, ("mm",), "0.19.1", None),
        # vLLM's own Scheduler: one hash for the same tokens in two domains.
        (COLLISION, LORA_SALT, "0.12.0", "F-KV9/scheduler"),
        (COLLISION, LORA_SALT, "0.30.0", "F-KV9/scheduler"),
        (COLLISION, LORA_SALT, "0.31.0", None),
        (COLLISION, MM_SALT, "0.12.0", "F-KV10/scheduler"),
        (COLLISION, ("lora", "mm"), "0.12.0", "F-KV10/scheduler"),
        (COLLISION, ("mm",), "0.12.0", "F-KV3/scheduler"),
        (COLLISION, ("mm",), "0.10.1.1", "F-KV3/scheduler"),  # seen by kvspec check --vllm 0.10.1.1 --seed 2
        (COLLISION, ("mm",), "0.19.1", None),
        (COLLISION, MM_SALT, "0.19.1", None),
        (COLLISION, MM_SALT, "0.10.1.1", "F-KV10/scheduler"),  # seen by kvspec check --vllm 0.10.1.1 --seed 2
        (COLLISION, MM_SALT, "0.9.1", None),
    ],
)
def test_a_collision_between_domains_is_labelled_by_the_domains_it_confused(form, domains, version, label):
    """F-KV9, F-KV10 and F-KV3 are one kind of violation told apart by the extra keys it confused (a
    fact, ``Violation.domains``), each inside the releases its bisect measured."""
    from kvspec.spec.violation import Violation
    from kvspec.testing.blockmanager.driver import SpecViolation, TraceStep
    from kvspec.testing.known import label_failures

    impl, invariant, kind = form
    known = [k for k in load_known([SHIPPED]) if k.concerns(impl, version)]
    violation = Violation(invariant, "the same tokens in two domains", kind=kind, seqs=(0, 1), domains=domains)
    error = SpecViolation([violation], [TraceStep("arrive" if impl == "v1-scheduler" else "admit", {"seq": 1})])
    ((fp, found),) = label_failures(known, error, Config(block_size=2, num_blocks=4, prefix_caching=True))
    assert fp.invariant == invariant
    assert (found.id if found else None) == label


# A crash in 0.9.1's cache_full_blocks under vLLM's Scheduler (FINDINGS V1-S4a) and a block freed
# under a pending KV send at an abort (V1-S6), beside their neighbours.
CACHE_FULL_BLOCKS = Fingerprint(CRASH, "step", "AssertionError", "vllm/v1/core/block_pool.py:cache_full_blocks")
FREED_AT_ABORT = Fingerprint("kv-readback", "abort")
FREED_IN_STEP = Fingerprint("kv-readback", "step")
SENDING = ("freed-while-sending",)


def _shape(**kw):
    from kvspec.spec.groups import Shape

    base = dict(
        block_size=2, swa_block_size=2, sliding_window=2, extra_blocks=0, prefix_caching=True,
        num_spec_tokens=0, async_scheduling=False, max_num_batched_tokens=16, max_model_len=16,
        full_sequence_must_fit=False, max_tokens=2,
    )
    return Shape(**{**base, **kw})


@pytest.mark.parametrize(
    "impl, version, fp, kinds, shape, caching, label",
    [
        # The window group nulls the block the next hash chains from: 0.9.1 under the Scheduler ...
        ("v1-scheduler", "0.9.1", CACHE_FULL_BLOCKS, (), _shape(), True, "V1-S4a"),
        # ... not without prefix caching or without a window group ...
        ("v1-scheduler", "0.9.1", CACHE_FULL_BLOCKS, (), _shape(prefix_caching=False), False, None),
        ("v1-scheduler", "0.9.1", CACHE_FULL_BLOCKS, (), _shape(sliding_window=None), True, None),
        # ... nor in the same function from 0.10.1.1 (V1-S2b's other assert there) ...
        ("v1-scheduler", "0.10.1.1", CACHE_FULL_BLOCKS, (), _shape(), True, "V1-S2b"),
        # ... and the block manager's form of the same assert is V1-b.
        ("v1", "0.9.1", CACHE_FULL_BLOCKS, (), None, True, "V1-b"),
        # An abort that frees the blocks a deferred KV send reads: 0.10.1.1-0.10.2 ...
        ("v1-scheduler", "0.10.1.1", FREED_AT_ABORT, SENDING, _shape(kv_connector="NixlConnector"), False, "V1-S6"),
        # ... not once finish_requests skips finished requests (0.12.0) ...
        ("v1-scheduler", "0.12.0", FREED_AT_ABORT, SENDING, _shape(kv_connector="NixlConnector"), False, None),
        # ... nor a free at the finish itself (a step), nor another kv-readback fault at an abort.
        ("v1-scheduler", "0.10.1.1", FREED_IN_STEP, SENDING, _shape(), False, None),
        ("v1-scheduler", "0.10.1.1", FREED_AT_ABORT, ("no-slot",), _shape(), False, None),
    ],
)
def test_a_null_parent_hash_and_an_abort_under_a_send_are_labelled_in_their_releases(
    impl, version, fp, kinds, shape, caching, label
):
    from kvspec.testing.known import Evidence, which_known

    known = [k for k in load_known([SHIPPED]) if k.concerns(impl, version)]
    evidence = Evidence(crash="AssertionError: ") if fp.invariant == CRASH else Evidence(kinds=frozenset(kinds))
    config = Config(block_size=2, num_blocks=8, sliding_window=2, prefix_caching=caching)
    found = which_known(known, fp, evidence, config, {fp.operation, "arrive"}, shape)
    assert (found.id if found else None) == label


def test_a_go_on_finding_names_only_its_kinds_so_another_kind_of_its_invariant_is_not_gone_past():
    """V1-e (a wrong usage figure) is gone on past at every state of its releases; a
    conservation violation of another kind shown beside it (a double free) is a failure of its
    own: labelled on its own facts, the Sieve's new target, never gone past as V1-e."""
    from types import SimpleNamespace

    from kvspec.cli.search import Sieve
    from kvspec.spec.invariants import Violation
    from kvspec.testing import SpecViolation
    from kvspec.testing.blockmanager.driver import TraceStep
    from kvspec.testing.blockmanager.machine import CONTINUE
    from kvspec.testing.known import label_failures, step_past_known

    e = KnownFinding("E", "usage", ("conservation",), ("admit",), kind=("wrong-usage",), go_on=True)
    d = KnownFinding("D", "double free", ("conservation",), ("admit",), kind=("double-free",))
    config = Config(block_size=2, num_blocks=4)
    driver = SimpleNamespace(config=config, trace=[TraceStep("admit", {"seq": 0}, "ok")])
    wrong = Violation("conservation", "usage off", kind="wrong-usage")
    double = Violation("conservation", "block 1 freed twice", kind="double-free")
    both = SpecViolation([wrong, double], driver.trace)
    fp = Fingerprint("conservation", "admit")
    assert label_failures([e], SpecViolation([wrong], driver.trace), config) == [(fp, e)]
    assert label_failures([e], both, config) == [(fp, e), (fp, None)]
    assert label_failures([e, d], both, config) == [(fp, e), (fp, d)]

    sieve = Sieve(frozenset(), [e], frozenset({"E"}))
    assert sieve(SpecViolation([wrong], driver.trace), driver) == CONTINUE  # type: ignore[arg-type]
    assert sieve(both, driver) is False and sieve.target == fp  # type: ignore[arg-type]
    assert step_past_known([e], "reference", None)(both, driver) is False
    assert step_past_known([e, d], "reference", None)(both, driver) is True  # D: discarded, not gone on
