"""FINDINGS.md keeps itself true: every finding in its triage index has a label from the three
allowed, a release range, a pin (or the reason it cannot be pinned), a fingerprint in
testing/known_findings.toml (or the reason it has none), and a write-up in docs/upstream/ when
it is a vLLM bug still seen on the newest release; every id the detailed tables use is in the
index (or among the runs that found nothing); the "Seen, not yet triaged" section is empty.
The checks run on the real file and on mutated copies, to show each one can fail."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = ROOT / "FINDINGS.md"
KNOWN = ROOT / "testing" / "known_findings.toml"
UPSTREAM = ROOT / "docs" / "upstream"
NEWEST = "0.33.0"  # the newest release the project provisions (targets/registry.py PINNED)

LABELS = ("vLLM bug", "by design upstream", "kvspec's mistake")
COLUMNS = ("id", "label", "upstream", "releases", "pin", "production relevance", "fingerprint")
ID = re.compile(r"^(F\d+|C\d+|P\d+|M\d+|V1-[A-Za-z0-9]+|F-KV\d+)$")
VERSION = re.compile(r"\d+\.\d+\.\d+")


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def index_rows(text: str) -> list[dict[str, str]]:
    rows = []
    for line in _section(text, "Triage index").splitlines():
        cells = _cells(line)
        if not line.startswith("|") or cells[0] in ("id", "---"):
            continue
        rows.append(dict(zip(COLUMNS, cells + [""] * (len(COLUMNS) - len(cells)), strict=False)))
    return rows


def problems(text: str, known_ids: set[str], upstream_docs: set[str]) -> list[str]:
    """Every way FINDINGS.md fails the record's rules (empty: it keeps them)."""
    found: list[str] = []
    rows = index_rows(text)
    ids = [r["id"] for r in rows]
    if not rows:
        return ["the triage index has no rows"]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        found.append(f"{dup}: listed twice in the triage index")
    for r in rows:
        rid = r["id"]
        if not ID.match(rid):
            found.append(f"{rid!r}: not a finding id")
        if not r["label"].startswith(LABELS):
            found.append(f"{rid}: label {r['label']!r} is none of {LABELS}")
        if r["label"].startswith("by design upstream") and "the spec still forbids it" not in (
            r["production relevance"].lower()
        ):
            found.append(f"{rid}: by design upstream, but the row does not say why the spec still forbids it")
        if not VERSION.search(r["releases"]):
            found.append(f"{rid}: no release range")
        if "tests/" not in r["pin"] and not r["pin"].startswith(("cannot be pinned", "via ")):
            found.append(f"{rid}: no pin and no reason it cannot be pinned")
        if not r["upstream"]:
            found.append(f"{rid}: no upstream threads (or 'none found')")
        fp = r["fingerprint"]
        if not (fp.split(" ", 1)[0] in known_ids or (fp.startswith("none:") and len(fp) > len("none: "))):
            found.append(f"{rid}: fingerprint {fp!r} is not in known_findings.toml and states no reason")
        seen_newest = re.search(rf"seen on [^;]*{re.escape(NEWEST)}", r["releases"])
        if r["label"].startswith("vLLM bug") and seen_newest and rid not in upstream_docs:
            found.append(f"{rid}: a vLLM bug seen on {NEWEST} without docs/upstream/{rid}.md")
    listed = set(ids)
    runs = _section(text, "Triage index").split("Runs that found nothing", 1)
    if len(runs) == 2:
        words = re.findall(r"[A-Z][A-Za-z0-9]*(?:-[A-Za-z0-9]+)*", runs[1].split("\n\n", 1)[0])
        listed |= {w for w in words if ID.match(w)}
    body = text.replace(_section(text, "Triage index"), "")
    for line in body.splitlines():
        cells = _cells(line) if line.startswith("|") else []
        if cells and ID.match(cells[0]) and cells[0] not in listed:
            found.append(f"{cells[0]}: used in a table but not in the triage index")
    # "ID/form": a second fingerprint of one finding (another operation or symptom of it).
    for kid in sorted(k for k in known_ids if k.split("/", 1)[0] not in listed):
        found.append(f"{kid}: in known_findings.toml but not in the triage index")
    for doc in sorted(upstream_docs - listed):
        found.append(f"docs/upstream/{doc}.md names no finding of the index")
    untriaged = _section(text, "Seen, not yet triaged")
    if re.search(r"^\s*[-*+] ", untriaged, re.MULTILINE):
        found.append("the 'Seen, not yet triaged' section still holds items")
    return found


def _known_ids() -> set[str]:
    return {e["id"] for e in tomllib.loads(KNOWN.read_text())["finding"]}


def _docs() -> set[str]:
    return {p.stem for p in UPSTREAM.glob("*.md") if p.stem != "README"}


def test_findings_md_keeps_the_record():
    assert problems(FINDINGS.read_text(), _known_ids(), _docs()) == []


def _mutate_row(text: str, rid: str, column: str, value: str) -> str:
    rows = index_rows(text)
    row = next(r for r in rows if r["id"] == rid)
    old = "| " + " | ".join(row[c] for c in COLUMNS) + " |"
    assert old in text, "the index rows are written one cell per column"
    new = "| " + " | ".join(value if c == column else row[c] for c in COLUMNS) + " |"
    return text.replace(old, new, 1)


@pytest.mark.parametrize(
    ("column", "value", "complaint"),
    [
        ("releases", "", "no release range"),
        ("label", "probably fine", "is none of"),
        ("pin", "", "no pin"),
        ("fingerprint", "Z9", "fingerprint"),
        ("upstream", "", "no upstream threads"),
    ],
)
@pytest.mark.parametrize("rid", ["F1", "V1-d"])  # a legacy row and a V1-engine row
def test_an_entry_that_loses_a_field_fails(rid, column, value, complaint):
    text = _mutate_row(FINDINGS.read_text(), rid, column, value)
    assert any(p.startswith(f"{rid}:") and complaint in p for p in problems(text, _known_ids(), _docs()))


def test_a_by_design_entry_must_say_why_the_spec_still_forbids_it():
    text = FINDINGS.read_text()
    row = next(r for r in index_rows(text) if r["id"] == "F2")
    text = _mutate_row(text, "F2", "production relevance", row["production relevance"].split(". The spec")[0])
    assert any(p.startswith("F2:") and "forbids" in p for p in problems(text, _known_ids(), _docs()))


def test_a_bug_on_the_newest_release_needs_its_write_up():
    assert any(p.startswith("C3:") for p in problems(FINDINGS.read_text(), _known_ids(), _docs() - {"C3"}))


def test_an_untriaged_item_or_an_unindexed_id_fails():
    text = FINDINGS.read_text()
    untriaged = text.replace("## Seen, not yet triaged", "## Seen, not yet triaged\n\n- something new\n", 1)
    assert "the 'Seen, not yet triaged' section still holds items" in problems(untriaged, _known_ids(), _docs())
    starred = text.replace("## Seen, not yet triaged", "## Seen, not yet triaged\n\n* something new\n", 1)
    assert "the 'Seen, not yet triaged' section still holds items" in problems(starred, _known_ids(), _docs())
    assert any("F99" in p for p in problems(text, _known_ids() | {"F99"}, _docs()))


def test_a_report_of_a_known_finding_links_its_write_up():
    from kvspec.testing.known import SHIPPED, load_known

    known = {k.id: k for k in load_known([SHIPPED])}
    assert known["C3"].cite() == f"known finding C3 (FINDINGS.md; write-up: {UPSTREAM / 'C3.md'})"
    assert known["F1"].cite() == "known finding F1 (FINDINGS.md)"  # legacy: no write-up
