"""How many reported violations got a verified standalone reproducer, and how long the files are.

    python -m bench.reproducers DIR [DIR ...]

Each DIR is a ``kvspec check --out`` folder (or a folder above several); every report.json
below it is one reported violation or crash.  Counts every report, verified or not, so the
share is over everything the runs reported.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def measure(folders: list[Path]) -> dict:
    rows = []
    for folder in folders:
        for report_path in sorted(folder.rglob("report.json")):
            report = json.loads(report_path.read_text())
            repro = report.get("reproducer") or {}
            lines = code = None
            if repro.get("status") == "verified" and repro.get("path"):
                text = Path(repro["path"]).read_text()
                lines = len(text.splitlines())
                body = text.split('"""', 2)[-1] if text.startswith('"""') else text
                code = sum(1 for line in body.splitlines() if line.strip() and not line.strip().startswith("#"))
            found = report.get("violations") or []
            rows.append(
                {
                    "report": str(report_path),
                    "outcome": report.get("outcome"),
                    "invariant": found[0]["invariant"] if found else "crash",
                    "status": repro.get("status", "none"),
                    "reason": repro.get("reason"),
                    "lines": lines,
                    "code_lines": code,
                }
            )
    verified = [r for r in rows if r["status"] == "verified"]
    sizes = [r["lines"] for r in verified]
    return {
        "reports": len(rows),
        "verified": len(verified),
        "share": len(verified) / len(rows) if rows else None,
        "lines_median": statistics.median(sizes) if sizes else None,
        "lines_max": max(sizes) if sizes else None,
        "rows": rows,
    }


def cmd_reproducers(*, folders: list[Path], json_path: Path | None) -> None:
    """Print one line per report below ``folders`` and the share with a verified reproducer;
    with ``json_path``, also write the figures there."""
    result = measure(folders)
    for r in result["rows"]:
        size = f"{r['lines']} lines ({r['code_lines']} code)" if r["lines"] else r["reason"] or ""
        print(f"{r['status']:<16} {r['invariant']:<26} {size}  {r['report']}")
    share = f"{result['share']:.0%}" if result["share"] is not None else "-"
    print(
        f"{result['verified']} of {result['reports']} reported violations have a verified reproducer ({share}); "
        f"lines: median {result['lines_median']}, max {result['lines_max']}"
    )
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    from .__main__ import main

    sys.exit(main(["reproducers", *sys.argv[1:]]))
