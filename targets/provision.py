"""Create or reuse the virtualenv of a vLLM release, and install kvspec into it.

Plain ``pip install vllm==X`` into a fresh venv: the release's real, unmodified code, with
its own pinned torch.  Measured here: 0.6.3 takes ~2.5 min and 6.8 GB, 0.33.0 ~3 min and
9.4 GB.  Nothing is written into the checkout; a failed install removes the half-made venv.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .registry import Target, TargetError, home, target

NEEDED_GB = {"legacy": 8, "v1": 11}
REPO = Path(__file__).resolve().parent.parent

Progress = Callable[[str], None]


def released_versions(timeout: float = 20) -> set[str]:
    try:
        with urllib.request.urlopen("https://pypi.org/pypi/vllm/json", timeout=timeout) as resp:
            return set(json.load(resp)["releases"])
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        raise TargetError(f"cannot reach PyPI to look up vLLM releases: {err}") from err


def check_disk(t: Target) -> None:
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    free_gb = shutil.disk_usage(root).free / 2**30
    need = NEEDED_GB[t.engine]
    if free_gb < need:
        raise TargetError(
            f"not enough disk for vLLM {t.version}: {free_gb:.1f} GiB free under {root}, "
            f"about {need} GiB needed (set KVSPEC_HOME to a larger disk)"
        )


def _run(cmd: list[str], progress: Progress, what: str) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = [*tail[-19:], line]
        if line.startswith(("Collecting", "Downloading", "Installing", "Successfully", "ERROR")):
            progress(f"  {line[:110]}")
    if proc.wait() != 0:
        raise TargetError(f"{what} failed (exit {proc.returncode}):\n" + "\n".join(tail))


def kvspec_is_current(t: Target) -> bool:
    marker = t.venv / "kvspec-source.txt"
    return marker.exists() and marker.read_text().strip() == str(REPO)


def install_kvspec(t: Target, progress: Progress) -> None:
    """(Re)install this checkout of kvspec into the target venv, editable."""
    if kvspec_is_current(t):
        return
    progress(f"installing kvspec from {REPO} into {t.venv}")
    _run(
        [str(t.python), "-m", "pip", "install", "-q", "-e", str(REPO)],
        progress,
        "installing kvspec",
    )
    (t.venv / "kvspec-source.txt").write_text(str(REPO))


def provision(version: str, progress: Progress = print, *, engine: str | None = None) -> Target:
    t = target(version, engine)
    if t.is_provisioned():
        progress(f"vLLM {version}: reusing {t.venv}")
        install_kvspec(t, progress)
        return t
    if version not in released_versions():
        raise TargetError(f"vLLM {version} is not a release on PyPI")
    check_disk(t)
    progress(f"vLLM {version}: creating {t.venv} (several minutes, several GB)")
    if t.venv.exists():
        shutil.rmtree(t.venv)  # a half-made venv from an interrupted run
    t.venv.parent.mkdir(parents=True, exist_ok=True)
    try:
        _run([sys.executable, "-m", "venv", str(t.venv)], progress, "creating the venv")
        _run(
            [str(t.python), "-m", "pip", "install", f"vllm=={version}"],
            progress,
            f"pip install vllm=={version}",
        )
        install_kvspec(t, progress)
    except BaseException:
        shutil.rmtree(t.venv, ignore_errors=True)
        raise
    progress(f"vLLM {version}: ready at {t.venv}")
    return t
