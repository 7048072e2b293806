"""``python -m kvspec.proofs [--deep] [--list] [--json FILE] [ID-PREFIX ...]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import run_all
from .core import select
from .report import console, summary, table, to_json


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvspec.proofs", description=__doc__)
    parser.add_argument("selection", nargs="*", help="obligation IDs or ID prefixes (default: all)")
    parser.add_argument("--deep", action="store_true", help="deeper bounds and longer timeouts")
    parser.add_argument("--list", action="store_true", help="list the obligations and exit")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)
    out = console()
    chosen = select(args.selection or None, args.deep)
    if not chosen:
        out.print(f"no obligation matches {args.selection}")
        return 2
    if args.list:
        for ob in chosen:
            out.print(f"{ob.id}  [{ob.expected}]  {ob.statement}")
        return 0
    with out.status("proving...") as status:
        results = run_all(
            args.selection or None,
            args.deep,
            on_result=lambda r: status.update(f"proving... {r.obligation}: {r.outcome}"),
        )
    out.print(table(results, "kvspec proofs" + (" (deep)" if args.deep else "")))
    out.print(summary(results))
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
