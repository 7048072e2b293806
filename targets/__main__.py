"""``python -m kvspec.targets provision VERSION ...`` (also ``kvspec provision``)."""

from __future__ import annotations

import sys

from .provision import provision
from .registry import TargetError


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "provision":
        print("usage: python -m kvspec.targets provision VERSION [VERSION ...]", file=sys.stderr)
        return 2
    for version in args[1:]:
        try:
            provision(version)
        except TargetError as err:
            print(f"kvspec: {err}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
