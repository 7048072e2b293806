"""What a target venv holds: the record of its installed distributions, and what is suspect in it.

Two files per release:

* ``$KVSPEC_HOME/locks/vllm-X.txt``: the dated resolution (``uv pip compile --generate-hashes
  --exclude-newer``): every pinned version with the hashes of its release files.  It outlives
  the venv, so a re-provisioned venv installs exactly the same set again.
* ``<venv>/kvspec-lock.json``: whether the venv is lean (targets/lean.py) and which pins it
  left out, and what is installed, read from the venv's ``*.dist-info``
  folders: name, version, installer, and the sha256 of the distribution's RECORD (the list
  of its installed files with each file's own sha256, so one digest pins the installed
  content).  Written after provisioning, and on reuse when it is missing (venvs made by
  plain pip get one the first time they are reused).

Flags: a distribution that is a known placeholder (a squatted or emptied name on PyPI), or
that installs nothing but a package template's leftovers (top-level ``sample``/``tests``
modules instead of its own), is flagged in the provision output and in ``kvspec targets``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

RECORD_NAME = "kvspec-lock.json"
SCHEMA = 1
# The distributions `kvspec targets` summarises (the rest is counted).
HEADLINE = ("vllm", "torch", "transformers", "numpy")


@attrs.frozen
class Placeholder:
    """A name whose PyPI release today is not the project a vLLM release meant."""

    reason: str
    # module path -> source of a stand-in kvspec writes when a release imports the name
    # eagerly (None: the name is only left out)
    stand_in: dict[str, str] | None = None


KNOWN_PLACEHOLDERS: dict[str, Placeholder] = {
    "pyairports": Placeholder(
        reason=(
            "squatted placeholder on PyPI (0.0.1, uploaded 2025-09-25, ships top-level 'sample' and "
            "'tests' packages and no 'pyairports' module; the project outlines 0.0.x depended on "
            "was removed)"
        ),
        # outlines 0.0.4x's outlines/types/airports.py builds an Enum from AIRPORT_LIST at import;
        # vLLM 0.5.x imports outlines when vllm is imported.  kvspec never runs guided decoding.
        stand_in={
            "pyairports/__init__.py": '"""kvspec stand-in: the PyPI project is gone."""\n',
            "pyairports/airports.py": (
                '"""kvspec stand-in: no airports (guided decoding by airport code is not run)."""\n\n'
                "AIRPORT_LIST: list[tuple[str, ...]] = []\n"
            ),
        },
    ),
}
STAND_IN_VERSION = "0+kvspec.standin"
STAND_IN_INSTALLER = "kvspec"
# Top-level modules a package template leaves behind: a distribution shipping only these
# (and not a module of its own) is not the project its name promises.
TEMPLATE_TOP_LEVEL = frozenset({"sample", "tests", "test", "example", "examples", "src"})


def canonical(name: str) -> str:
    """PEP 503 normalised distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class Installed:
    """One installed distribution."""

    name: str  # canonical
    version: str
    installer: str  # pip, uv, ... ("" when the venv does not say)
    record_sha256: str  # sha256 of the dist-info RECORD ("" when it has none)
    top_level: tuple[str, ...]  # the top-level modules its files install


@attrs.frozen
class Flag:
    name: str
    version: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}: {self.reason}"


@attrs.frozen
class LockRecord:
    """The installed state of one target venv."""

    vllm: str
    python: str
    method: str  # "uv, dated" (kvspec provision) or "pip, as found" (a reused venv kvspec did not make)
    cutoff: str | None  # the --exclude-newer date of a dated resolution
    dropped: tuple[str, ...]  # requirements left out of the resolution, each with its reason
    lockfile: str | None  # the dated resolution with hashes, when there is one
    packages: tuple[Installed, ...]
    # A lean venv (targets/lean.py) installs the dated resolution without some distributions;
    # ``left_out`` names each pin it did not install, with the reason.
    lean: bool = False
    left_out: tuple[str, ...] = ()
    # Files a lean venv removed from installed distributions (``provision.prune_unloaded``), each
    # with its size and reason.
    pruned: tuple[str, ...] = ()

    def version_of(self, name: str) -> str | None:
        want = canonical(name)
        return next((p.version for p in self.packages if p.name == want), None)

    def flags(self) -> list[Flag]:
        return flag(self.packages)

    def summary(self) -> str:
        """``vllm 0.5.4, torch 2.4.0, transformers 4.44.0, numpy 1.26.4 + 118 more``."""
        shown = [f"{name} {self.version_of(name) or '-'}" for name in HEADLINE]
        rest = len(self.packages) - sum(self.version_of(n) is not None for n in HEADLINE)
        return f"{', '.join(shown)} + {rest} more"

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "vllm": self.vllm,
            "python": self.python,
            "method": self.method,
            "cutoff": self.cutoff,
            "dropped": list(self.dropped),
            "lockfile": self.lockfile,
            "lean": self.lean,
            "left_out": list(self.left_out),
            "pruned": list(self.pruned),
            "flags": [str(f) for f in self.flags()],
            "packages": [attrs.asdict(p) for p in self.packages],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LockRecord:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"lock record schema {data.get('schema')!r}, expected {SCHEMA}")
        packages = tuple(
            Installed(
                name=p["name"],
                version=p["version"],
                installer=p.get("installer", ""),
                record_sha256=p.get("record_sha256", ""),
                top_level=tuple(p.get("top_level", ())),
            )
            for p in data["packages"]
        )
        return cls(
            vllm=data["vllm"],
            python=data["python"],
            method=data["method"],
            cutoff=data.get("cutoff"),
            dropped=tuple(data.get("dropped", ())),
            lockfile=data.get("lockfile"),
            packages=packages,
            lean=bool(data.get("lean", False)),
            left_out=tuple(data.get("left_out", ())),
            pruned=tuple(data.get("pruned", ())),
        )


def flag(packages: Iterable[Installed]) -> list[Flag]:
    """Known placeholders, and distributions that install only template leftovers."""
    out = []
    for p in packages:
        if p.name in KNOWN_PLACEHOLDERS:
            reason = KNOWN_PLACEHOLDERS[p.name].reason
            if p.installer == STAND_IN_INSTALLER:
                reason = f"a stand-in module written by kvspec, because the name is a {reason}"
            out.append(Flag(p.name, p.version, reason))
            continue
        own = {m.lower() for m in p.top_level} - TEMPLATE_TOP_LEVEL
        template = sorted({m.lower() for m in p.top_level} & TEMPLATE_TOP_LEVEL)
        if template and not own:
            out.append(
                Flag(
                    p.name,
                    p.version,
                    f"installs only template modules ({', '.join(template)}), none of its own: likely a placeholder",
                )
            )
    return out


def write_stand_in(site: Path, name: str) -> Path:
    """Install kvspec's stand-in for a placeholder name into ``site`` (a site-packages folder)
    as a distribution of its own (``STAND_IN_VERSION``, INSTALLER ``kvspec``)."""
    files = KNOWN_PLACEHOLDERS[name].stand_in
    if not files:
        raise ValueError(f"kvspec has no stand-in for {name}")
    written = []
    for rel, text in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append((rel, path.read_bytes()))
    info = site / f"{name}-{STAND_IN_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {STAND_IN_VERSION}\n"
        f"Summary: kvspec stand-in for a name PyPI no longer serves as the release knew it\n"
    )
    (info / "INSTALLER").write_text(STAND_IN_INSTALLER + "\n")
    (info / "top_level.txt").write_text(name + "\n")
    rows = [f"{rel},sha256={hashlib.sha256(data).hexdigest()},{len(data)}" for rel, data in written]
    rows += [f"{info.name}/{f},," for f in ("METADATA", "INSTALLER", "top_level.txt", "RECORD")]
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return info


def requirements(venv: Path) -> dict[str, set[str]]:
    """Each installed distribution -> the names it requires (markers ignored, extras left out)."""
    out: dict[str, set[str]] = {}
    for meta in sorted(venv.glob("lib/python*/site-packages/*.dist-info/METADATA")):
        owner, deps = "", set()
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Name:") and not owner:
                owner = canonical(line.split(":", 1)[1].strip())
            elif line.startswith("Requires-Dist:"):
                spec = line.split(":", 1)[1].strip()
                m = _REQ_NAME.match(spec)
                if m and "extra ==" not in spec:
                    deps.add(canonical(m.group(0)))
            elif not line.strip():
                break
        if owner:
            out.setdefault(owner, set()).update(deps)
    return out


def required_by(venv: Path, name: str) -> list[str]:
    """The installed distributions that require ``name`` (outside extras)."""
    want = canonical(name)
    return sorted(owner for owner, deps in requirements(venv).items() if want in deps)


_REQ_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _top_level(dist_info: Path, record: list[str]) -> tuple[str, ...]:
    listed = dist_info / "top_level.txt"
    if listed.is_file():
        names = {ln.strip() for ln in listed.read_text(errors="replace").splitlines() if ln.strip()}
    else:
        names = set()
        for line in record:
            path = line.split(",", 1)[0]
            head = path.split("/", 1)[0]
            if not path or head.startswith("..") or head.endswith((".dist-info", ".data")):
                continue
            if "/" in path or path.endswith((".py", ".so", ".pth")):
                names.add(head.removesuffix(".py").split(".")[0])
    return tuple(sorted(n for n in names if not n.startswith("__")))


def read_dist_info(dist_info: Path) -> Installed | None:
    """One ``*.dist-info`` folder; None when it has no METADATA (a broken leftover)."""
    meta = dist_info / "METADATA"
    if not meta.is_file():
        return None
    name = version = ""
    for line in meta.read_text(errors="replace").splitlines():
        if line.startswith("Name:") and not name:
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Version:") and not version:
            version = line.split(":", 1)[1].strip()
        elif not line.strip():
            break  # the headers end at the first blank line
    if not name:
        return None
    record = dist_info / "RECORD"
    record_bytes = record.read_bytes() if record.is_file() else b""
    installer = dist_info / "INSTALLER"
    return Installed(
        name=canonical(name),
        version=version,
        installer=installer.read_text(errors="replace").strip() if installer.is_file() else "",
        record_sha256=hashlib.sha256(record_bytes).hexdigest() if record_bytes else "",
        top_level=_top_level(dist_info, record_bytes.decode(errors="replace").splitlines()),
    )


def scan(venv: Path) -> tuple[Installed, ...]:
    """Every distribution installed in a venv's site-packages, by name."""
    found: dict[str, Installed] = {}
    for site in sorted(venv.glob("lib/python*/site-packages")):
        for dist_info in sorted(site.glob("*.dist-info")):
            got = read_dist_info(dist_info)
            if got is not None:
                found.setdefault(got.name, got)
    return tuple(sorted(found.values(), key=lambda p: p.name))


def record_path(venv: Path) -> Path:
    return venv / RECORD_NAME


def write_record(venv: Path, record: LockRecord) -> Path:
    path = record_path(venv)
    path.write_text(json.dumps(record.to_json(), indent=1) + "\n")
    return path


def read_record(venv: Path) -> LockRecord | None:
    """The venv's record; None when it has none (or an unreadable one, rewritten on reuse)."""
    path = record_path(venv)
    if not path.is_file():
        return None
    try:
        return LockRecord.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError):
        return None


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
_HASH = re.compile(r"--hash=(sha256:[0-9a-f]{64})")


def parse_requirements_lock(text: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``name==version`` pins of a hashed requirements file (uv pip compile / pip-compile
    output, continuation lines and comments allowed) -> {canonical name: (version, hashes)}."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    current: str | None = None
    for raw in text.splitlines():
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        m = _PIN.match(line)
        if m:
            current = canonical(m.group(1))
            out[current] = (m.group(2), ())
        elif not line.startswith("--hash"):
            current = None  # an option line (--index-url ...) or an unpinned requirement
        if current is not None:
            version, hashes = out[current]
            out[current] = (version, hashes + tuple(_HASH.findall(line)))
    return out
