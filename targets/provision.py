"""Create or reuse the virtualenv of a vLLM release, and install kvspec into it.

A new venv gets the release's real, unmodified code with the dependencies PyPI offered on the
day of the release, not today's: ``uv pip compile --exclude-newer <cut-off> --generate-hashes``
resolves ``vllm==X`` (the cut-off is the upload time of the release's newest file plus
``CUTOFF_SLACK``, from PyPI's JSON), the hashed resolution is kept under
``$KVSPEC_HOME/locks`` and installed with ``uv pip sync``.  A release's own pins (0.6.3 ->
torch 2.4.0) come from PyPI as the release asks; this machine's pip constraints do not apply
to uv.  Names PyPI no longer serves as the release knew them (``KNOWN_PLACEHOLDERS``) are
left out of the resolution and said so.

"ready" is said only after the block-manager modules of every manager the release ships
(``registry.SHIPPED``) import in the new venv; otherwise the half-made venv is removed and
the import error shown.  Every venv gets a record of its installed distributions
(``lock.py``); a venv made earlier by plain pip is reused as it is and gets its record on
reuse, with placeholders flagged.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs

from .disk import detach, discard, provision_lock, remove_empty_folders, trim, trimmed_entries
from .lean import (
    CUDA_TORCH_REASON,
    cpu_torch_wheel,
    cuda_torch_closure,
    lean_requirements,
    left_out_reason,
    prunable_files,
    trimmed_reason,
)
from .lock import (
    KNOWN_PLACEHOLDERS,
    Flag,
    LockRecord,
    flag,
    parse_requirements_lock,
    read_record,
    record_path,
    required_by,
    requirements,
    scan,
    write_record,
    write_stand_in,
)
from .registry import SHIPPED, Target, TargetError, home, target

NEEDED_GB = {"legacy": 8, "v1": 11}
# A lean venv (targets/lean.py) leaves out 2-3 GiB of a release (BENCHMARKS.md, "Lean targets").
NEEDED_GB_LEAN = {"legacy": 6, "v1": 8}
REPO = Path(__file__).resolve().parent.parent
PYPI_JSON = "https://pypi.org/pypi/vllm/json"
# Dependencies published up to a day after the release's last file still count as the
# release's own (companion packages such as vllm-flash-attn are uploaded alongside).
CUTOFF_SLACK = timedelta(days=1)
IMPORT_TIMEOUT_S = 600
# What a fresh venv holds before anything is installed into it.
BOOTSTRAP = frozenset({"pip", "setuptools", "wheel"})
RESOLVE_TIMEOUT_S = 900
INSTALL_TIMEOUT_S = 3600

Progress = Callable[[str], None]


# ------------------------------------------------------------------------------ PyPI


@functools.cache
def _pypi(timeout: float = 20) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(PYPI_JSON, timeout=timeout) as resp:
            return json.load(resp)
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as err:
        raise TargetError(f"cannot reach PyPI to look up vLLM releases: {err}") from err


def released_versions() -> set[str]:
    return set(_pypi()["releases"])


def release_cutoff(files: list[dict[str, Any]]) -> datetime:
    """The dependency date cut-off of a release, from its files' PyPI JSON entries: the
    newest file's upload time plus ``CUTOFF_SLACK``."""
    stamps = []
    for f in files:
        raw = f.get("upload_time_iso_8601") or f.get("upload_time")
        if not raw:
            continue
        stamp = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        stamps.append(stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC))
    if not stamps:
        raise TargetError("PyPI lists no uploaded file for this release, so it has no date")
    return max(stamps) + CUTOFF_SLACK


def cutoff_for(version: str) -> datetime:
    releases = _pypi()["releases"]
    if version not in releases:
        raise TargetError(f"vLLM {version} is not a release on PyPI")
    return release_cutoff(releases[version])


def _stamp(when: datetime) -> str:
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------ tools


def uv_binary() -> str:
    """The uv of this interpreter's environment (a kvspec dependency), else one on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if found is None:
        raise TargetError(
            "uv is not installed (kvspec depends on it to resolve a release's dependencies "
            "as of its date): pip install uv"
        )
    return found


def _uv(*args: str) -> list[str]:
    return [uv_binary(), *args, "--cache-dir", str(home() / "uv-cache")]


def lock_path(version: str) -> Path:
    return home() / "locks" / f"vllm-{version}.txt"


def lean_lock_path(version: str) -> Path:
    """The dated resolution without ``lean.LEFT_OUT`` (what a lean venv installs)."""
    return home() / "locks" / f"vllm-{version}.lean.txt"


def check_disk(t: Target, *, full: bool = True) -> None:
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(root).free / 2**30
    need = (NEEDED_GB if full else NEEDED_GB_LEAN)[t.engine]
    if free_gb < need:
        raise TargetError(
            f"not enough disk for vLLM {t.version}: {free_gb:.1f} GiB free under {root}, "
            f"about {need} GiB needed (set KVSPEC_HOME to a larger disk)"
        )


# Installer output lines worth showing while a venv is made (the rest only on failure).
_SHOWN = ("Collecting", "Downloading", "Installing", "Installed", "Successfully", "Resolved", "Prepared", "error")


def _run(cmd: list[str], progress: Progress, what: str, *, timeout: float, cwd: Path | None = None) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    tail: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-29:], line]
        if line.lstrip().startswith(_SHOWN):
            progress(f"  {line.strip()[:110]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise TargetError(f"{what} took longer than {timeout:.0f} s:\n" + "\n".join(tail))
    if proc.wait() != 0:
        raise TargetError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))


# ------------------------------------------------------------------------------ kvspec in the venv


FINDER_MODULE = "_kvspec_checkout"


def kvspec_stamp() -> str:
    """Which requirements the installed kvspec was made with (a new dependency in
    pyproject.toml must reach every target venv) and which checkout finder it carries.  The
    checkout itself is not part of it: every checkout runs its own code in the venv
    (``checkout_finder``)."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    finder = hashlib.sha256((REPO / "targets" / "checkout_finder.py").read_bytes()).hexdigest()[:16]
    return f"pyproject {digest}\nfinder {finder}"


def kvspec_is_current(t: Target) -> bool:
    marker = t.venv / "kvspec-source.txt"
    return marker.exists() and marker.read_text().strip() == kvspec_stamp()


def install_finder(t: Target) -> None:
    """Copy the checkout finder into the venv's site-packages, with the ``.pth`` line that
    installs it at interpreter start."""
    site = next(iter(sorted(t.venv.glob("lib/python*/site-packages"))))
    shutil.copyfile(REPO / "targets" / "checkout_finder.py", site / f"{FINDER_MODULE}.py")
    (site / f"{FINDER_MODULE}.pth").write_text(f"import {FINDER_MODULE}; {FINDER_MODULE}.install()\n")


def install_kvspec(t: Target, progress: Progress) -> bool:
    """Install kvspec's requirements into the target venv (kvspec itself editable from this
    checkout) and the checkout finder; whether it did.  uv keeps every installed distribution
    that satisfies kvspec's requirements as it is."""
    if kvspec_is_current(t):
        return False
    progress(f"installing kvspec from {REPO} into {t.venv}")
    _run(
        _uv("pip", "install", "--python", str(t.python), "-e", str(REPO)),
        progress,
        "installing kvspec",
        timeout=INSTALL_TIMEOUT_S,
    )
    install_finder(t)
    (t.venv / "kvspec-source.txt").write_text(kvspec_stamp())
    return True


def bytecode_marker(t: Target) -> Path:
    return t.venv / "kvspec-bytecode.txt"


def compile_bytecode(t: Target, progress: Progress) -> bool:
    """Byte-compile the venv's site-packages once; whether it did.  Every target process imports
    vLLM, torch and transformers; with ``PYTHONDONTWRITEBYTECODE`` set (as in many CI images)
    and no .pyc on disk, each process compiled thousands of modules from source again (half of
    a scheduler run's time, measured with cProfile on 0.33.0).  A .pyc is read whatever that
    variable says."""
    marker = bytecode_marker(t)
    if marker.exists():
        return False
    progress(f"byte-compiling {t.venv} (once)")
    sites = [str(p) for p in sorted(t.venv.glob("lib/python*/site-packages"))]
    # Some distributions ship files that are not Python 3 (templates, test data): compileall
    # exits 1 for them, as uv's --compile-bytecode skips them; the rest is compiled either way.
    subprocess.run(
        [str(t.python), "-m", "compileall", "-q", "-j", "0", *sites],
        capture_output=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )
    marker.write_text("python -m compileall\n")
    return True


# ------------------------------------------------------------------------------ checks


def release_modules(version: str) -> tuple[str, ...]:
    """The block-manager modules of every manager the release ships, in either engine."""
    return tuple(s.module for s in SHIPPED if s.ships_in(version))


_IMPORT_PROBE = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "    print('imported', name, flush=True)\n"
)


def write_stand_ins(t: Target, progress: Progress) -> None:
    """kvspec's stand-ins for the placeholder names the installed distributions require."""
    site = next(iter(sorted(t.venv.glob("lib/python*/site-packages"))))
    for name, ph in sorted(KNOWN_PLACEHOLDERS.items()):
        users = required_by(t.venv, name)
        if users and ph.stand_in and not any(p.name == name for p in scan(t.venv)):
            write_stand_in(site, name)
            progress(f"wrote kvspec's stand-in for {name} (required by {', '.join(users)}): {ph.reason}")


def check_imports(t: Target, progress: Progress, modules: tuple[str, ...] | None = None) -> None:
    """Import ``modules`` (default: the release's block-manager modules) in the venv (not from
    the checkout's cwd)."""
    modules = release_modules(t.version) if modules is None else modules
    progress(f"importing {', '.join(modules)} in {t.venv}")
    try:
        proc = subprocess.run(
            [str(t.python), "-c", _IMPORT_PROBE, *modules],
            cwd=t.venv,
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise TargetError(f"importing the block managers of vLLM {t.version} hung ({err.timeout} s)") from err
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        cause = lines[-1] if lines else f"exit {proc.returncode}"
        raise TargetError(
            f"vLLM {t.version}'s block managers do not import in {t.venv}: {cause}\n" + "\n".join(lines[-12:-1])
        )


def kvspec_closure(venv: Path) -> set[str]:
    """kvspec and every distribution it requires, transitively, in the venv."""
    requires = requirements(venv)
    seen, todo = set(), ["kvspec"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(requires.get(name, ()))
    return seen


def make_record(
    t: Target,
    *,
    method: str,
    cutoff: str | None,
    dropped: tuple[str, ...],
    left_out: tuple[str, ...] | None = None,
    pruned: tuple[str, ...] = (),
) -> LockRecord:
    """``left_out``: the pins a lean venv did not install, each with its reason (None: a full venv);
    ``pruned``: the files ``prune_unloaded`` removed, each with its size and reason."""
    lock = lock_path(t.version)
    return LockRecord(
        vllm=t.version,
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        method=method,
        cutoff=cutoff,
        dropped=dropped,
        lockfile=str(lock) if lock.is_file() else None,
        packages=scan(t.venv),
        lean=left_out is not None,
        left_out=left_out or (),
        pruned=pruned,
    )


def report(record: LockRecord, venv: Path, progress: Progress) -> None:
    progress(f"installed ({record.method}): {record.summary()} (full list: {record_path(venv)})")
    for f in [*record.flags(), *unexpected_for_release(record, venv)]:
        progress(f"FLAGGED {f}")
    newer = newer_than_release(record)
    if newer:
        progress(
            f"{len(newer)} distributions differ from the release's dated resolution "
            f"({record.lockfile}), e.g. {', '.join(newer[:4])}"
        )


def newer_than_release(record: LockRecord) -> list[str]:
    """``name installed (dated: version)`` for every pin of the dated resolution the venv
    holds at another version."""
    if not record.lockfile or not Path(record.lockfile).is_file():
        return []
    pins = parse_requirements_lock(Path(record.lockfile).read_text())
    return [
        f"{p.name} {p.version} (dated: {pins[p.name][0]})"
        for p in record.packages
        if p.name in pins and pins[p.name][0] != p.version
    ]


def unexpected_for_release(record: LockRecord, venv: Path) -> list[Flag]:
    """Installed distributions that neither the dated resolution nor kvspec's own
    requirements account for."""
    if not record.lockfile or not Path(record.lockfile).is_file():
        return []
    pins = parse_requirements_lock(Path(record.lockfile).read_text())
    ours = kvspec_closure(venv)
    known = {f.name for f in record.flags()}
    return [
        Flag(p.name, p.version, "not in the release's dated resolution nor required by kvspec")
        for p in record.packages
        if p.name not in pins and p.name not in ours and p.name not in BOOTSTRAP and p.name not in known
    ]


def ensure_record(t: Target, progress: Progress) -> LockRecord:
    """The venv's record; written now from what is installed when it has none.  A venv kvspec
    did not resolve (plain pip) is compared with the release's dated resolution, made now."""
    record = read_record(t.venv)
    if record is not None and record.vllm == t.version:
        return record
    installers = {p.installer for p in scan(t.venv) if p.name == "vllm"}
    if "uv" in installers and lock_path(t.version).is_file():
        record = make_record(t, method="uv, dated", cutoff=None, dropped=())
    else:
        cutoff: str | None = None
        dropped: tuple[str, ...] = ()
        try:
            when = cutoff_for(t.version)
            _, dropped = resolve(t, when, progress)
            cutoff = _stamp(when)
        except TargetError as error:
            progress(f"cannot compare with the release's dated resolution: {first_line(str(error))}")
        record = make_record(t, method="pip, as found", cutoff=cutoff, dropped=dropped)
    path = write_record(t.venv, record)
    progress(f"recorded the installed distributions of {t.venv} in {path}")
    return record


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# ------------------------------------------------------------------------------ provision


# setuptools: a plain venv ships it and the releases' dependencies rely on that without
# declaring it (triton 3.0's runtime/build.py imports it when torch loads its backends).
EXTRA_REQUIREMENTS = ("setuptools",)


def recipe(version: str, cutoff: datetime) -> str:
    """What a dated resolution was made from; a kept lock made from another recipe is stale."""
    wanted = " ".join([f"vllm=={version}", *EXTRA_REQUIREMENTS])
    return f"# kvspec recipe: {wanted}; as of {_stamp(cutoff)}; left out: {' '.join(sorted(KNOWN_PLACEHOLDERS))}"


def resolve(t: Target, cutoff: datetime, progress: Progress) -> tuple[Path, tuple[str, ...]]:
    """The release's dated, hashed resolution (kept under $KVSPEC_HOME/locks)."""
    lock = lock_path(t.version)
    dropped = tuple(f"{name}: {ph.reason}" for name, ph in sorted(KNOWN_PLACEHOLDERS.items()))
    head = recipe(t.version, cutoff)
    if lock.is_file() and lock.read_text().startswith(head + "\n"):
        progress(f"reusing the dated resolution {lock}")
        return lock, dropped
    lock.parent.mkdir(parents=True, exist_ok=True)
    work = lock.parent / f".vllm-{t.version}"
    work.mkdir(exist_ok=True)
    (work / "requirements.in").write_text("".join(f"{r}\n" for r in (f"vllm=={t.version}", *EXTRA_REQUIREMENTS)))
    # A marker that never holds removes a requirement (uv's documented override idiom).
    (work / "overrides.txt").write_text(
        "".join(f"{name} ; sys_platform == 'never'\n" for name in sorted(KNOWN_PLACEHOLDERS))
    )
    progress(f"resolving vllm=={t.version} as of {_stamp(cutoff)} (uv --exclude-newer)")
    partial = lock.with_suffix(".partial")
    cmd = _uv("pip", "compile", str(work / "requirements.in"), "--overrides", str(work / "overrides.txt"))
    cmd += ["--exclude-newer", _stamp(cutoff), "--generate-hashes", "--python", str(t.python)]
    cmd += ["--no-header", "-o", str(partial)]
    try:
        _run(cmd, progress, f"resolving vllm=={t.version} as of {_stamp(cutoff)}", timeout=RESOLVE_TIMEOUT_S)
        notes = "".join(f"# left out: {d}\n" for d in dropped)
        lock.write_text(f"{head}\n# resolved by uv (--exclude-newer), hashed\n{notes}{partial.read_text()}")
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    return lock, dropped


def lean_resolution(version: str, lock: Path) -> tuple[Path, tuple[str, ...]]:
    """Write the lean variant of a dated resolution; it and the pins it leaves out, each with
    its reason."""
    text, removed = lean_requirements(lock.read_text())
    lean = lean_lock_path(version)
    note = "# lean (targets/lean.py): left out " + (" ".join(removed) or "nothing") + "\n"
    lean.write_text(note + text)
    return lean, tuple(f"{pin}: {left_out_reason(pin.split('==', 1)[0])}" for pin in removed)


def cpu_lean_resolution(version: str, lean: Path) -> tuple[Path, dict[str, str]]:
    """The lean resolution without torch's CUDA closure (``lean.cuda_torch_closure``), for a venv
    that gets a CPU build of torch, and the names it leaves out."""
    closure = cuda_torch_closure(lean.read_text())
    text, _ = lean_requirements(lean.read_text(), closure)
    cpu = lean.with_name(f"vllm-{version}.lean-cpu.txt")
    cpu.write_text(text)
    return cpu, closure


def install_cpu_torch(t: Target, lean: Path, wheel: Path, progress: Progress) -> tuple[str, ...]:
    """Install the lean resolution with ``wheel`` (a CPU build of torch) in place of torch's CUDA
    closure; the pins left out for it, each with its reason."""
    cpu, closure = cpu_lean_resolution(t.version, lean)
    removed = [pin for name, pin in _pins(lean) if name in closure]
    progress(f"CPU torch: {wheel.name} in place of {len(removed)} CUDA distributions (--full keeps them)")
    _sync(t, cpu, progress)
    _run(
        _uv("pip", "install", "--compile-bytecode", "--no-deps", "--python", str(t.python), str(wheel)),
        progress,
        f"installing {wheel.name}",
        timeout=INSTALL_TIMEOUT_S,
    )
    return tuple(f"{pin}: {closure[pin.split('==', 1)[0]]}: {wheel.name}" for pin in removed)


def _pins(lock: Path) -> list[tuple[str, str]]:
    return [(name, f"{name}=={version}") for name, (version, _) in parse_requirements_lock(lock.read_text()).items()]


def _sync(t: Target, lock: Path, progress: Progress, *, reinstall: bool = False) -> None:
    """``reinstall``: link every distribution anew (a lean venv made full: some of its
    distributions came from cache entries trimmed for lean venvs, ``discard_trimmed``)."""
    pins = parse_requirements_lock(lock.read_text())
    progress(f"installing {len(pins)} pinned distributions from {lock}")
    _run(
        _uv("pip", "sync", "--compile-bytecode", *(["--reinstall"] * reinstall), "--python", str(t.python), str(lock)),
        progress,
        f"installing the resolution of vllm=={t.version}",
        timeout=INSTALL_TIMEOUT_S,
    )


def prune_unloaded(t: Target, progress: Progress) -> tuple[str, ...]:
    """Remove from a lean venv the files of its distributions that no kvspec process loads
    (``lean.prunable_files``: beside a CPU torch, vLLM's CUDA extensions; beside torch's CUDA
    build, the CUDA libraries nothing links; either way the shared distributions' files of
    ``lean.TRIMMED_SHARED_FILES``), so that their bytes are freed: vLLM's and the CUDA libraries'
    uv cache entries are detached from the venv first (``disk.detach``), a shared distribution's
    entry loses the same files (``disk.trim``) and stays for the next venv.  Each removed file (the
    smaller ones counted per reason) with its size and reason, and the files a trimmed entry
    already lacked when this venv was linked from it."""
    site = next(iter(sorted(t.venv.glob("lib/python*/site-packages"))))
    absent = _already_trimmed(site)
    files = prunable_files(site)
    detached: list[str] = []
    trimmed: list[Path] = []
    by_reason: dict[str, list[tuple[Path, int]]] = {}
    for path, reason in files:
        st = path.lstat()
        relative = path.relative_to(site).as_posix()
        shared = trimmed_reason(relative) is not None
        if st.st_nlink > 1 and shared:  # a shared wheel's cache entry: remove the file from it too
            trim(path, relative, trimmed)
        elif st.st_nlink > 1:  # still linked from uv's cache: detach that wheel's entry first
            gone = detach(path, relative)
            detached += [f"{gone[0].name} ({path.relative_to(site).parts[0]})"] if gone else []
        by_reason.setdefault(reason, []).append((path, st.st_size))
        path.unlink()
        if shared:
            remove_empty_folders(path, site)
    removed = []  # each file of 1 MiB or more by name, the rest counted per reason
    for reason, group in by_reason.items():
        removed += [f"{path.relative_to(site)} ({n / 2**20:.1f} MiB): {reason}" for path, n in group if n >= 2**20]
        small = [(path, n) for path, n in group if n < 2**20]
        if small:
            kinds = " ".join(sorted({path.suffix or path.name for path, _ in small}))
            if len(kinds) > 80:
                kinds = kinds[:77] + "..."
            size = sum(n for _, n in small)
            removed.append(f"{len(small)} smaller files ({kinds}; {size / 2**20:.1f} MiB): {reason}")
    removed += [
        f"{n} files already absent ({size / 2**20:.1f} MiB; trimmed from uv's shared cache entry by an "
        f"earlier lean provisioning): {reason}"
        for reason, (n, size) in absent.items()
    ]
    if files:
        total = sum(n for group in by_reason.values() for _, n in group)
        where = [
            *([f"uv cache entries detached: {', '.join(detached)}"] if detached else []),
            *([f"shared uv cache entries trimmed alike: {len(trimmed)}"] if trimmed else []),
        ]
        said = "; ".join(where) or "nothing linked from uv's cache"
        progress(f"lean: removed {len(files)} files no kvspec process loads, {total / 2**20:.0f} MiB ({said})")
    return tuple(removed)


def _already_trimmed(site: Path) -> dict[str, tuple[int, int]]:
    """Per reason, the number and bytes of the files of ``lean.TRIMMED_SHARED_FILES`` that the
    venv's RECORDs list and it lacks: uv linked it from an entry an earlier provisioning trimmed."""
    import csv

    found: dict[str, tuple[int, int]] = {}
    for record in site.glob("*.dist-info/RECORD"):
        for row in csv.reader(record.read_text(errors="replace").splitlines()):
            reason = trimmed_reason(row[0]) if row else None
            if reason is not None and not (site / row[0]).exists():
                n, size = found.get(reason, (0, 0))
                found[reason] = (n + 1, size + (int(row[2]) if len(row) > 2 and row[2].isdigit() else 0))
    return found


def discard_trimmed(progress: Progress) -> int:
    """Before a full venv is synced: discard the cache entries a lean provisioning trimmed
    (``disk.trimmed_entries``), so that uv unpacks those wheels whole again."""
    entries = trimmed_entries()
    for entry in entries:
        discard(entry)
    if entries:
        progress(f"full: discarded {len(entries)} uv cache entries trimmed for lean venvs (unpacked whole again)")
    return len(entries)


# The V1 scheduler adapter's vLLM modules (adapters/v1_scheduler.py).
V1_SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler", "vllm.v1.outputs", "vllm.v1.structured_output")


def driven_modules(t: Target) -> tuple[str, ...]:
    """What a lean venv must import: the block-manager modules, and on V1 the scheduler."""
    return (*release_modules(t.version), *(V1_SCHEDULER_MODULES if t.engine == "v1" else ()))


def provision(version: str, progress: Progress = print, *, engine: str | None = None, full: bool = False) -> Target:
    """Make (or reuse) the venv of a release.  A new venv is lean (targets/lean.py) unless
    ``full``; a lean venv whose driven modules do not import gets the full resolution."""
    t = target(version, engine)
    if t.is_provisioned():
        progress(f"vLLM {version}: reusing {t.venv}")
        kept_record = read_record(t.venv)
        if full and kept_record is not None and kept_record.lean:
            progress(
                f"vLLM {version}: the venv is lean; for a full one: kvspec targets --prune {version} --yes, "
                f"then kvspec provision --full {version}"
            )
        reinstalled = install_kvspec(t, progress)
        compile_bytecode(t, progress)
        record = ensure_record(t, progress)
        if reinstalled:  # kvspec's own requirements may have brought distributions in
            record = attrs.evolve(record, packages=scan(t.venv))
            write_record(t.venv, record)
        report(record, t.venv, progress)
        return t
    cutoff = cutoff_for(version)
    check_disk(t, full=full)
    progress(f"vLLM {version}: creating {t.venv} ({'full' if full else 'lean'}; several minutes, several GB)")
    if t.venv.exists():
        shutil.rmtree(t.venv)  # a half-made venv from an interrupted run
    t.venv.parent.mkdir(parents=True, exist_ok=True)
    kept = lock_path(version).read_text() if lock_path(version).is_file() else None
    started = time.monotonic()
    # Shared: several venvs may be made at once; `kvspec targets --prune` refuses while one is.
    with provision_lock(exclusive=False):
        try:
            _run(_uv("venv", "--python", sys.executable, str(t.venv)), progress, "creating the venv", timeout=300)
            lock, dropped = resolve(t, cutoff, progress)
            left_out: tuple[str, ...] | None = None
            pruned: tuple[str, ...] = ()
            if full:
                discard_trimmed(progress)
                _sync(t, lock, progress)
            else:
                lean, left_out = lean_resolution(version, lock)
                progress(f"lean: leaving out {len(left_out)} distributions (--full keeps them)")
                pinned_torch = parse_requirements_lock(lean.read_text()).get("torch", (None,))[0]
                python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
                wheel = cpu_torch_wheel(pinned_torch, python_tag) if pinned_torch else None
                if wheel is None:
                    progress(
                        "lean: no CPU build of torch on this machine (a torch-X+cpu wheel in $KVSPEC_TORCH_WHEELS "
                        "or pip's find-links): installing torch's CUDA build"
                    )
                    _sync(t, lean, progress)
                else:
                    left_out = (*left_out, *install_cpu_torch(t, lean, wheel, progress))
            install_kvspec(t, progress)
            write_stand_ins(t, progress)
            imported = False
            pruned_early = False
            if left_out is not None and any(CUDA_TORCH_REASON in why for why in left_out):
                # vLLM's compiled extensions link torch's CUDA libraries, which a CPU build of torch
                # does not ship, so they cannot load here; removed before the import check, vLLM
                # takes its own path for a build without them (0.6.3: _core_ext.py:10 and
                # _custom_ops.py:15-19) instead of finding them and failing to load them (0.6.3's
                # `_core_C` then left `ScalarType` unregistered and the import failed).
                pruned = prune_unloaded(t, progress)
                pruned_early = True
                try:
                    check_imports(t, progress, driven_modules(t))
                except TargetError as error:
                    progress(
                        f"the lean venv with a CPU torch does not import what kvspec drives "
                        f"({first_line(str(error))}); installing torch's CUDA build"
                    )
                    # Every distribution linked anew: vLLM's extensions come back with its wheel
                    # (downloaded again: pruning detached its cache entry).
                    _sync(t, lean, progress, reinstall=True)
                    pruned, pruned_early = (), False
                    (t.venv / "kvspec-source.txt").unlink(missing_ok=True)
                    install_kvspec(t, progress)
                    write_stand_ins(t, progress)
                    left_out = tuple(why for why in left_out if CUDA_TORCH_REASON not in why)
                else:
                    imported = True
            if left_out is not None and not imported:
                try:
                    check_imports(t, progress, driven_modules(t))
                except TargetError as error:
                    progress(
                        f"the lean venv does not import what kvspec drives ({first_line(str(error))}); "
                        "installing the full resolution"
                    )
                    trimmed = discard_trimmed(progress)
                    # removes kvspec and the stand-ins: not in the resolution
                    _sync(t, lock, progress, reinstall=trimmed > 0)
                    (t.venv / "kvspec-source.txt").unlink(missing_ok=True)
                    install_kvspec(t, progress)
                    write_stand_ins(t, progress)
                    left_out = None
            if left_out is not None and not pruned_early:
                pruned = prune_unloaded(t, progress)
            bytecode_marker(t).write_text("uv pip sync --compile-bytecode\n")
            check_imports(t, progress, driven_modules(t) if pruned else None)
            record = make_record(
                t, method="uv, dated", cutoff=_stamp(cutoff), dropped=dropped, left_out=left_out, pruned=pruned
            )
            write_record(t.venv, record)
        except BaseException:
            shutil.rmtree(t.venv, ignore_errors=True)
            lock = lock_path(version)
            if lock.is_file() and lock.read_text() != kept:  # a resolution this failed run made goes too
                lock.unlink()
            progress(f"vLLM {version}: failed; removed {t.venv}")
            raise
    report(record, t.venv, progress)
    progress(f"vLLM {version}: ready at {t.venv} ({time.monotonic() - started:.0f} s)")
    return t


__all__ = [
    "REPO",
    "check_imports",
    "ensure_record",
    "flag",
    "install_kvspec",
    "lock_path",
    "provision",
    "release_cutoff",
    "released_versions",
]
