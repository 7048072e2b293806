"""Where a run happens, and with which implementation.

A vLLM target is one of:

* the vLLM importable by this interpreter (the default; what a contributor has installed),
* a release, ``--vllm X``: its provisioned venv (``kvspec.targets``), where the command
  re-executes itself (``<venv>/bin/python -m kvspec.cli ... --_in-target``) because vLLM can
  only be imported there,
* a source checkout, ``--vllm-source PATH``: the contributor's branch, run in the venv of the
  nearest provisioned release with ``PYTHONPATH=PATH`` in front.  The block managers are pure
  Python, so no CUDA kernel is built: the venv's release supplies torch and the other
  dependencies, the checkout supplies ``vllm``.  A checkout whose import chain needs a newer
  dependency, or imports ``vllm._C`` unguarded, fails to import; the import error's first
  lines are shown and the exit code is 2.

Nothing here imports vLLM itself: files are located with ``importlib.util.find_spec`` (which
does not execute the package) and every import goes through ``kvspec.adapters``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.errors import ConfigError, Unsupported
from kvspec.targets.registry import V1_FROM, Target, TargetError, home, release_key, target, unsupported_v1
from kvspec.testing import implementations
from kvspec.testing.guard import DEFAULT_MEMORY_CAP_GIB, Guard, GuardTripped, Limits
from kvspec.testing.implementations import Factory, by_manager

from .common import UsageError, captured_fds, err, first_lines

IN_TARGET_FLAG = "--_in-target"


def impl_names() -> list[str]:
    return implementations.names()


def check_impl_name(name: str | None) -> None:
    if name is None:
        return
    try:
        implementations.lookup(name)
    except implementations.UnknownImplementation as error:
        raise UsageError(str(error), "kvspec targets lists what each release ships") from None


def vllm_names() -> tuple[str, ...]:
    return implementations.vllm_names()


def needs_vllm(impl: str | None) -> bool:
    return impl is None or implementations.lookup(impl).is_vllm


def is_kvspec_scheduler(name: str | None) -> bool:
    """Whether ``name`` is one of kvspec's own schedulers (the scheduler machine's targets
    that run without vLLM: testing/implementations.py ``SCHEDULERS``)."""
    scheduler = implementations.SCHEDULERS.get(name) if name is not None else None
    return scheduler is not None and not scheduler.is_vllm


def factory_for(impl: str) -> Factory:
    """The implementation factory the machine calls with each drawn configuration."""
    return implementations.factory(impl)


# ------------------------------------------------------------------------------ locating vLLM


@attrs.frozen
class VllmHere:
    """The vLLM this interpreter would import (located, not imported)."""

    path: Path  # the vllm package folder
    version: str
    kind: str  # "local", "release" or "source"
    source: Path | None = None
    venv_release: str | None = None

    @property
    def label(self) -> str:
        return "vLLM (version unknown)" if self.version == "unknown" else f"vLLM {self.version}"

    def generations(self) -> dict[str, bool]:
        return generations(self.path)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "vllm_version": self.version,
            "vllm_path": str(self.path),
            "source_path": str(self.source) if self.source else None,
            "venv_release": self.venv_release,
            "python": sys.executable,
        }


def generations(vllm_dir: Path) -> dict[str, bool]:
    """Which engine generations' block managers a vLLM tree ships (by file, no import)."""
    return {
        "legacy": (vllm_dir / "core" / "interfaces.py").is_file(),
        "v1": (vllm_dir / "v1" / "core" / "kv_cache_manager.py").is_file(),
    }


def locate_vllm() -> Path | None:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin and spec.origin not in ("namespace", "built-in"):
        return Path(spec.origin).resolve().parent
    locations = list(spec.submodule_search_locations or [])
    return Path(locations[0]).resolve() if locations else None


def installed_version(path: Path) -> str | None:
    """The installed distribution's version, if that distribution is the vllm at ``path``."""
    try:
        dist = importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        located = Path(str(dist.locate_file("vllm"))).resolve()
    except (OSError, TypeError):
        return None
    return dist.version if located == path else None


_VERSION_RE = re.compile(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""")


def read_source_version(root: Path) -> str | None:
    """The version of a vLLM tree: ``vllm/_version.py`` (setuptools-scm), a neighbouring
    ``*.dist-info``, a static pyproject/setup.py version, or ``git describe``."""
    generated = root / "vllm" / "_version.py"
    if generated.is_file():
        m = _VERSION_RE.search(generated.read_text(errors="replace"))
        if m:
            return m.group(1)
    for meta in sorted(root.glob("vllm-*.dist-info/METADATA")):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        m = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    setup = root / "setup.py"
    if setup.is_file():
        m = re.search(r"""\bversion\s*=\s*['"](\d[^'"]*)['"]""", setup.read_text(errors="replace"))
        if m:
            return m.group(1)
    if (root / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "-C", str(root), "describe", "--tags", "--abbrev=0"],
                capture_output=True,
                text=True,
                timeout=20,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        tag = out.stdout.strip()
        if out.returncode == 0 and tag:
            return tag[1:] if tag.startswith("v") else tag
    return None


def validate_checkout(path: str) -> Path:
    root = Path(path).expanduser()
    if not root.exists():
        raise UsageError(
            f"--vllm-source {path}: no such directory", "pass the root of a vLLM checkout"
        )
    root = root.resolve()
    if root.name == "vllm" and (root / "__init__.py").is_file() and not (root / "vllm").is_dir():
        raise UsageError(
            f"--vllm-source {path} is the vllm package folder, not the checkout root",
            f"pass its parent: --vllm-source {root.parent}",
        )
    package = root / "vllm"
    if not (package / "__init__.py").is_file():
        raise UsageError(
            f"{root} is not a vLLM checkout: there is no vllm/__init__.py in it",
            "pass the root of a vLLM source tree (the folder holding vllm/, setup.py, ...)",
        )
    gens = generations(package)
    if not (gens["legacy"] or gens["v1"] or (package / "core").is_dir()):
        raise UsageError(
            f"{root} is not a vLLM checkout kvspec can drive: it has neither vllm/core "
            "(legacy block managers) nor vllm/v1/core (the V1 KVCacheManager)",
            "pass the root of a vLLM source tree",
        )
    return root


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:4])


def provisioned_targets() -> list[Target]:
    """Every release with a complete venv under $KVSPEC_HOME/venvs."""
    found = []
    root = home() / "venvs"
    if not root.is_dir():
        return []
    for venv in sorted(root.glob("vllm-*")):
        version = venv.name.removeprefix("vllm-")
        try:
            t = target(version)
        except TargetError:
            t = _loose_target(version)
            if t is None:
                continue
        if t.is_provisioned():
            found.append(t)
    return sorted(found, key=lambda t: _numbers(t.version))


def _loose_target(version: str) -> Target | None:
    """A venv whose version the registry cannot parse (e.g. 0.10.1.1): usable for source runs."""
    nums = _numbers(version)
    if len(nums) < 3:
        return None
    engine = "v1" if nums[:3] >= (0, 8, 3) else "legacy"
    return Target(version, engine, ("v1",) if engine == "v1" else ("legacy-v2",))


def nearest_venv(version: str, gens: dict[str, bool]) -> Target:
    """The provisioned release nearest to ``version`` whose engine generation the checkout has."""
    candidates = provisioned_targets()
    if not candidates:
        raise UsageError(
            "no vLLM release is provisioned to run the checkout in",
            f"provision the checkout's release (or the nearest one) first: kvspec provision "
            f"{version if re.fullmatch(r'[0-9.]+(post[0-9]+)?', version) else '0.6.3'}",
        )
    for t in candidates:
        if t.version == version:
            return t
    want = _numbers(version)

    def distance(t: Target) -> tuple[int, tuple[int, ...]]:
        same_engine = gens.get(t.engine, False)
        nums = _numbers(t.version)
        padded = zip((nums + (0,) * 4)[:4], (want + (0,) * 4)[:4], strict=True)
        diff = tuple(abs(a - b) for a, b in padded)
        return (0 if same_engine else 1, diff)

    return min(candidates, key=distance)


def venv_for_source(version: str, gens: dict[str, bool], choice: str | None) -> Target:
    """The venv a checkout runs in: ``choice`` (``--venv``: a provisioned release, or the
    folder of any venv that has vLLM's dependencies), else the nearest provisioned release."""
    if choice is None:
        return nearest_venv(version, gens)
    engine = "v1" if gens.get("v1") else "legacy"
    folder = Path(choice).expanduser()
    if folder.is_dir():
        if not (folder / "bin" / "python").exists():
            raise UsageError(
                f"--venv {choice}: no bin/python in that folder",
                "name a virtualenv folder or a provisioned release (kvspec targets)",
            )
        dists = sorted(folder.glob("lib/python*/site-packages/vllm-*.dist-info"))
        release = dists[0].name.removeprefix("vllm-").removesuffix(".dist-info") if dists else "no vllm"
        return Target(release, engine, (), path=folder.resolve())
    for t in provisioned_targets():
        if t.version == choice:
            return t
    raise UsageError(
        f"--venv {choice}: neither a folder nor a provisioned vLLM release",
        f"kvspec provision {choice}, or name a venv folder",
    )


# ------------------------------------------------------------------------------ the target


def ensure_provisioned(
    version: str, *, recheck: bool = False, full: bool = False, engine: str | None = None
) -> Target:
    """The release's venv, provisioned (or reused) with this checkout of kvspec in it.
    ``recheck`` goes through provisioning on reuse too (which records and reports what the
    venv holds) rather than returning as soon as kvspec imports there; ``full``: a new venv
    gets the whole dated resolution, not the lean one (targets/lean.py); ``engine`` (the one an
    --impl runs on) is refused here, before provisioning, when kvspec cannot drive it there."""
    try:
        if engine is not None:
            target(version, engine)
        t = target(version)
    except TargetError as error:
        raise UsageError(
            str(error), "kvspec targets lists the known and provisioned releases"
        ) from None
    if not recheck and t.is_provisioned() and _kvspec_in(t):
        return t
    from kvspec.targets.provision import provision

    try:
        with err.status(f"provisioning vLLM {version} ...", spinner="dots"):
            return provision(version, progress=lambda msg: err.print(f"  {msg}", markup=False), full=full)
    except TargetError as error:
        raise UsageError(
            f"provisioning vLLM {version} failed: {first_lines(str(error), 8)}",
            "the first line says which step failed: resolving and downloading need PyPI, a venv "
            "needs 8-11 GiB under $KVSPEC_HOME (default ~/.cache/kvspec), and a release whose "
            "block managers do not import is removed again",
        ) from None


def _kvspec_in(t: Target) -> bool:
    """Whether the venv imports kvspec from this very checkout (then no reinstall is needed)."""
    from kvspec.targets.provision import REPO

    try:
        out = subprocess.run(
            [
                str(t.python),
                "-c",
                "import kvspec.targets.provision as p; print(p.REPO)",
            ],
            # Not the checkout: from there its own folder would import, installed or not.
            cwd=t.venv,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and Path(out.stdout.strip()) == REPO.resolve()


def reexec(python: Path, argv: list[str], *, pythonpath: Path | None = None) -> int:
    """Run the same kvspec command inside another interpreter; its exit code is ours."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH", "")) if p
        )
    cmd = [str(python), "-m", "kvspec.cli", *argv, IN_TARGET_FLAG]
    try:
        return subprocess.run(cmd, env=env, check=False).returncode
    except KeyboardInterrupt:
        return 130
    except OSError as error:
        raise UsageError(
            f"cannot run {python}: {error}", "kvspec provision the release again"
        ) from None


def here_for_release(version: str) -> VllmHere:
    path = locate_vllm()
    if path is None:
        raise UsageError(
            f"vLLM {version} is not importable in {sys.executable}", f"kvspec provision {version}"
        )
    got = installed_version(path) or "unknown"
    if got != version:
        raise UsageError(
            f"this interpreter has vLLM {got}, not {version}", f"kvspec provision {version}"
        )
    return VllmHere(path, version, "release")


def here_for_source(source: str, version: str | None) -> VllmHere:
    root = validate_checkout(source)
    path = locate_vllm()
    if path is None or path != (root / "vllm").resolve():
        raise UsageError(
            f"the checkout {root} is not what `import vllm` finds here (it finds {path})",
            "is another vllm earlier on sys.path (an editable install, a .pth file)?",
        )
    venv = Path(sys.prefix).name.removeprefix("vllm-")
    return VllmHere(path, version or "unknown", "source", source=root, venv_release=venv)


def here_local() -> VllmHere:
    path = locate_vllm()
    if path is None:
        raise UsageError(
            f"no vLLM is importable by this interpreter ({sys.executable})",
            "check the reference with --impl reference, a release with --vllm 0.6.3 (provisions "
            "it), or a checkout with --vllm-source PATH",
        )
    version = installed_version(path) or read_source_version(path.parent) or "unknown"
    return VllmHere(path, version, "local")


def _is_release(version: str) -> bool:
    try:
        release_key(version)
    except TargetError:
        return False
    return True


def choose_impl(here: VllmHere, impl: str | None) -> str:
    """The implementation to drive on this vLLM; refuse one it does not ship, by name."""
    gens = here.generations()
    where = f"{here.label} ({here.path})"
    if not (gens["legacy"] or gens["v1"]):
        raise UsageError(
            f"{where} is an unsupported engine generation: it has neither the legacy block "
            "managers (vllm/core) nor the V1 KVCacheManager (vllm/v1/core)",
            f"kvspec drives legacy 0.4.3 .. 0.10.2 and V1 {'.'.join(map(str, V1_FROM))} on; "
            "kvspec targets lists them",
        )
    why_not_v1 = unsupported_v1(here.version) if gens["v1"] and _is_release(here.version) else None
    if impl is None:
        if gens["v1"] and why_not_v1 is None:
            return "v1"  # the engine such releases run by default
        manager = _legacy_call(here, "default_manager")
        return by_manager(manager).name
    chosen = implementations.lookup(impl)
    engine, manager = chosen.engine, chosen.manager
    if engine == "v1" and why_not_v1 is not None:
        raise UsageError(f"{where}: {why_not_v1}", "kvspec targets lists what each release ships")
    if not gens[engine]:
        label = "legacy (vllm/core)" if engine == "legacy" else "V1 (vllm/v1/core)"
        if gens["legacy"]:
            available = [by_manager(m).name for m in _legacy_call(here, "available_managers")]
        else:
            available = ["v1"]
        raise UsageError(
            f"{where} has no {label} block managers, so --impl {impl} is unsupported here",
            f"available here: {', '.join(available)}",
        )
    if engine == "legacy":
        present = _legacy_call(here, "available_managers")
        if manager not in present:
            names = [by_manager(m).name for m in present] + (["v1"] if gens["v1"] else [])
            raise UsageError(
                f"{where} has no {manager!r} legacy block manager, so --impl {impl} is "
                "unsupported here",
                f"available here: {', '.join(names) or 'none'}",
            )
    return impl


def _legacy_call(here: VllmHere, name: str) -> Any:
    from kvspec.adapters import legacy

    with captured_fds() as noise:
        try:
            return getattr(legacy, name)()
        except Exception as error:
            failure = error
    raise import_failure(here, failure, noise)


def probe(here: VllmHere, impl: str) -> None:
    """Build the implementation once on a small configuration: vLLM imports, and the adapter
    understands this release's API.  Bad news is bad input (exit 2), with the first lines.
    A constructor that raises, hangs or runs away once vLLM has imported is the target's
    fault, not bad input: the guarded run meets it again and reports it as a crash."""
    guard = Guard(Limits(PROBE_TIMEOUT, DEFAULT_MEMORY_CAP_GIB), address_limit=False)
    factory = guard.wrap(factory_for(impl))
    with captured_fds() as noise, guard.armed():
        try:
            factory(Config(block_size=16, num_blocks=16))
            return
        except GuardTripped:
            return
        except Exception as error:
            if not _import_failed(error):
                return
            failure = error
    raise import_failure(here, failure, noise)


PROBE_TIMEOUT = 600.0  # seconds: the first build imports vLLM and torch


def _import_failed(error: BaseException) -> bool:
    """Whether ``error`` is an import failing (rather than code running after the import)."""
    if isinstance(error, ImportError | SyntaxError | Unsupported | ConfigError):
        return True
    return any(f.filename.startswith("<frozen importlib") for f in traceback.extract_tb(error.__traceback__))


def import_failure(here: VllmHere, error: BaseException, noise: list[str]) -> UsageError:
    where = f"{here.label} at {here.path}"
    detail = "".join(traceback.format_exception_only(type(error), error)).strip()
    if isinstance(error, Unsupported):
        return UsageError(
            f"{where}: {detail.split(': ', 1)[-1]}", "kvspec targets lists what each release ships"
        )
    if isinstance(error, ConfigError):
        return UsageError(
            f"{where}: kvspec's adapter does not know this API shape: {first_lines(detail, 3)}",
            "the release may be newer than the adapters; see kvspec targets",
        )
    frames = traceback.extract_tb(error.__traceback__)
    origin = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    hint = "run it with the release's own venv: --vllm VERSION"
    if here.kind == "release":
        hint = "the release's own venv fails to import it: kvspec provision it again, or report it"
    elif here.kind == "source":
        hint = (
            "the checkout needs dependencies the chosen venv lacks, or imports compiled "
            "kernels (vllm._C) unguarded; provision its exact release"
        )
    missing = getattr(error, "name", None) or ""
    if isinstance(error, ModuleNotFoundError) and missing.startswith("vllm."):
        # vLLM itself imported; a module kvspec's adapter needs is not in this vLLM.
        hint = (
            f"{here.label} has no module {missing}, which kvspec's adapter imports: kvspec targets "
            "lists the releases each adapter drives; report it if this release is among them"
        )
    return UsageError(f"{where} does not import: {first_lines(detail, 6)}{origin}", hint)


def current_engine(impl: str) -> str | None:
    chosen = implementations.lookup(impl)
    return chosen.engine if chosen.is_vllm else None
