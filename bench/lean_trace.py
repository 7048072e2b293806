"""Which distributions of a target venv anything kvspec drives loads (targets/lean.py's evidence).

    python -m bench.lean_trace run --out /tmp/trace -- kvspec check --vllm 0.33.0 --examples 20
    python -m bench.lean_trace run --out /tmp/trace -- $VENV/bin/python -m pytest tests/targets  # VENV: the release
    python -m bench.lean_trace report --venv ~/.cache/kvspec/venvs/vllm-0.33.0 /tmp/trace

``run`` puts a ``sitecustomize`` on PYTHONPATH (inherited by the target process a
``kvspec --vllm`` run re-executes into) that writes, when each Python process exits, every
file of a module in ``sys.modules``, every shared object in ``/proc/self/maps``, and (by an audit
hook) every file Python opened and every program it started (``open``, ``subprocess.Popen``,
``os.exec``/``os.posix_spawn`` events: the evidence for ``lean.TRIMMED_SHARED_FILES``).
``report`` maps those files to the venv's distributions by their RECORDs and lists the loaded
and the never-loaded ones with their sizes, and the names of ``lean.LEFT_OUT`` that were
loaded (which must be none).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvspec.targets.lean import LEFT_OUT, trimmed_reason
from kvspec.targets.lock import canonical

SITECUSTOMIZE = '''\
import atexit, os, sys
_out = os.environ.get("KVSPEC_TRACE_DIR")
if _out:
    _touched = set()
    def _audit(event, args):
        # files Python opens (open(), os.open, io.open_code) and programs it starts
        if event in ("open", "subprocess.Popen", "os.exec", "os.posix_spawn") and args:
            target = args[0]
            if isinstance(target, (list, tuple)) and target:
                target = target[0]
            if isinstance(target, bytes):
                target = os.fsdecode(target)
            if isinstance(target, str) and target.startswith("/"):
                _touched.add(target)
    sys.addaudithook(_audit)
    def _dump():
        files = {getattr(m, "__file__", None) for m in list(sys.modules.values())} - {None}
        files |= set(_touched)
        with open("/proc/self/maps") as maps:
            files |= {ln.split()[5] for ln in maps if len(ln.split()) >= 6 and ".so" in ln.split()[5]}
        with open(os.path.join(_out, f"{os.getpid()}.txt"), "w") as f:
            f.write(f"#exe {sys.executable}\\n" + "".join(f"{p}\\n" for p in sorted(files)))
    atexit.register(_dump)
    _exit = os._exit
    def _traced_exit(code):
        _dump()
        _exit(code)
    os._exit = _traced_exit
'''


def run(out: Path, command: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as hook:
        Path(hook, "sitecustomize.py").write_text(SITECUSTOMIZE)
        env = dict(os.environ, KVSPEC_TRACE_DIR=str(out))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hook, env.get("PYTHONPATH", "")) if p)
        return subprocess.run(command, env=env, check=False).returncode


def distributions(venv: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Every installed file -> its distribution, and each distribution's bytes."""
    site = next(iter(sorted(venv.glob("lib/python*/site-packages"))))
    owner: dict[str, str] = {}
    size: dict[str, int] = {}
    for info in site.glob("*.dist-info"):
        record = info / "RECORD"
        if not record.is_file():
            continue
        name = canonical(info.name.removesuffix(".dist-info").rsplit("-", 1)[0])
        for row in csv.reader(record.read_text(errors="replace").splitlines()):
            if row:
                path = os.path.normpath(site / row[0])
                owner[path] = name
                size[name] = size.get(name, 0) + (os.lstat(path).st_size if os.path.lexists(path) else 0)
    return owner, size


def touched(venv: Path, traces: list[Path]) -> set[str]:
    """Every file the venv's own processes loaded, opened or started (normalised paths)."""
    prefix = f"#exe {venv}"
    found: set[str] = set()
    for folder in traces:
        for trace in folder.glob("*.txt"):
            lines = trace.read_text().splitlines()
            if not lines or not lines[0].startswith(prefix):
                continue  # another interpreter (the core venv that re-executed into the target)
            found |= set(map(os.path.normpath, lines[1:]))
    return found


def loaded(venv: Path, traces: list[Path]) -> set[str]:
    owner, _ = distributions(venv)
    return {owner[p] for p in touched(venv, traces) if p in owner}


def trimmed_but_touched(venv: Path, traces: list[Path]) -> list[str]:
    """The files ``lean.TRIMMED_SHARED_FILES`` removes that the traced processes touched
    (which must be none)."""
    site = next(iter(sorted(venv.glob("lib/python*/site-packages"))))
    inside = (os.path.relpath(p, site) for p in touched(venv, traces) if p.startswith(f"{site}{os.sep}"))
    return sorted(rel for rel in inside if trimmed_reason(rel.replace(os.sep, "/")) is not None)


def report(venv: Path, traces: list[Path]) -> int:
    _, size = distributions(venv)
    used = loaded(venv, traces)
    mib = 2**20
    never = sorted(set(size) - used, key=lambda n: -size[n])
    print(f"loaded: {len(used)} distributions, {sum(size[n] for n in used) / mib:.0f} MiB")
    print(f"never loaded: {len(never)} distributions, {sum(size[n] for n in never) / mib:.0f} MiB")
    for name in never:
        print(f"  never loaded {size[name] / mib:8.1f} MiB  {name}{'  (left out)' if name in LEFT_OUT else ''}")
    wrong = sorted(used & set(LEFT_OUT))
    print(f"left out by targets/lean.py but loaded: {', '.join(wrong) or 'none'}")
    trimmed = trimmed_but_touched(venv, traces)
    print(f"removed by targets/lean.py (shared files) but loaded or opened: {', '.join(trimmed) or 'none'}")
    return 1 if wrong or trimmed else 0


if __name__ == "__main__":
    from .__main__ import main

    sys.exit(main(["lean-trace", *sys.argv[1:]]))
