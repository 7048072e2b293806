"""What a lean target venv leaves out of a release's dated resolution, and why that is safe.

A release's resolution installs what vLLM needs to serve a model on a GPU: attention and GEMM
kernels, kernel compilers, CUDA toolkit pieces, serving and tool-calling clients.  kvspec
imports only vLLM's block managers and its V1 scheduler, on the CPU.  A lean venv is the same
dated, hashed resolution minus the distributions in ``LEFT_OUT`` and minus the files of kept
distributions ``prunable_files`` names ("Files inside kept distributions" below); ``kvspec
provision --full`` installs all of it.

How the list was made (``python -m bench.lean_trace``; BENCHMARKS.md, "Lean targets", has the
commands and figures): every process of ``kvspec check --vllm 0.33.0 --examples 20``, of the
in-target suite ``tests/targets`` on 0.33.0, and of ``kvspec check --vllm 0.6.3 --impl
legacy-v2`` / ``legacy-v1`` ran in the full venvs with a ``sitecustomize`` that wrote, at exit,
the file of every module in ``sys.modules`` and every shared object in ``/proc/self/maps``;
each file was mapped to its distribution by the distributions' RECORDs.  A name is listed only
when no file of it was loaded on any traced release that installs it.  Then the same checks
(same seeds: the same verdicts and counts) and ``tests/targets`` ran in the lean venvs.

pycountry is kept although that trace never loaded it: beside a CPU torch, importing 0.20.1's
scheduler stops at "The `language_code` module requires pycountry", and on 0.25.1+ the
multimodal processors of an offline multimodal model import it.

Distributions that were loaded stay even when vLLM tolerates their absence
(triton: vLLM imports it when present; ray and mistral-common: 0.6.3 imports them;
fastsafetensors: 0.33.0's weight_utils.py imports it under tests/targets), because leaving
them out changes which code vLLM runs.  Loaded CUDA libraries (libcublas, libcudnn,
... which libtorch_cuda.so links) stay too.

The list is applied by name to any release: a name a release does not install is ignored.  A
lean venv whose block managers or scheduler do not import is made full instead (provision.py).

**A CPU build of torch.**  The rest of a lean venv's bulk is torch's CUDA build: PyPI's Linux
torch requires the CUDA libraries (``nvidia-*``, ``cuda-*``) and triton, and loads several of
them at import.  Where a CPU build of torch lies on this machine as a wheel (``cpu_torch_wheel``:
``$KVSPEC_TORCH_WHEELS`` or pip's local ``find-links``; PyPI serves none), a lean venv installs it
in place of the CUDA build and leaves out ``CUDA_TORCH_CLOSURE``: the CUDA libraries, triton,
and the torch extensions built against the CUDA build (torchvision, torchaudio, torchcodec,
xformers), which do not load beside a CPU torch.  Unlike ``LEFT_OUT`` this changes what vLLM's
import runs (no triton: vLLM's placeholder; ``vllm._C`` is not loaded either way on this CPU);
it leaves the code kvspec drives alone -- pure Python over lists and dicts, no tensor --, which
is checked, not assumed: the venv's driven modules must import, and BENCHMARKS.md ("Lean
targets") has the default checks and the in-target suite giving the same verdicts and the same
operation counts in both venvs.  The wheel's version need not be the release's pin (one CPU
build serves every release); the record says which was installed in place of what.  vLLM's own
compiled extensions link torch's CUDA build, so beside a CPU torch they are removed before the
import check (``prunable_files``), and vLLM's import takes the path it has for a build without
them (0.6.3: ``_core_ext.py``'s mock ``ScalarType``, ``_custom_ops.py``'s guarded import of
``vllm._C``); present but unloadable, 0.6.3's failed its import, which had made it fall back to
torch's CUDA build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from .lock import canonical

# What each left-out distribution is; the reason it is safe is the same for all (module
# docstring): no file of it was imported or mapped by anything kvspec drives.
LEFT_OUT: dict[str, str] = {
    name: what
    for what, names in (
        (
            "GPU attention / GEMM kernels and their compilers",
            (
                "flashinfer-python",
                "flashinfer-cubin",
                "flashinfer-jit-cache",
                "tokenspeed-triton",
                "tokenspeed-mla",
                "tilelang",
                "quack-kernels",
                "humming-kernels",
                "nvidia-cutlass-dsl",
                "nvidia-cutlass-dsl-libs-base",
                "nvidia-cutlass-dsl-libs-core",
                "nvidia-cutlass-dsl-libs-cu12",
                "nvidia-cutlass-dsl-libs-cu13",
                "cuda-tile",
                "xformers",
                "vllm-flash-attn",
            ),
        ),
        (
            "CUDA toolkit pieces no imported library links (compiler, NVVM, headers, tracing)",
            (
                "nvidia-cuda-nvcc",
                "nvidia-nvvm",
                "nvidia-cuda-cccl",
                "nvidia-cuda-crt",
                "nvidia-cudnn-frontend",
                "cuda-core",
                "nccl4py",
                "nccl-extensions",
                "nvtx",
            ),
        ),
        (
            "JIT compilers for numeric kernels",
            ("numba", "llvmlite"),
        ),
        (
            # ray[cgraph] requires it (0.12.0's resolution); only ray's NCCL collectives import it
            "CUDA arrays for ray's GPU channels (ray.util.collective, ray.experimental.channel)",
            ("cupy-cuda12x", "cupy-cuda11x"),
        ),
        (
            "media decoding, model loading and serving-side clients",
            (
                "pynvvideocodec",
                "instanttensor",
                "hf-xet",
                "anthropic",
            ),
        ),
    )
    for name in names
}


def left_out_reason(name: str) -> str:
    return f"{LEFT_OUT[canonical(name)]}; never imported or mapped by what kvspec drives (targets/lean.py)"


_PIN_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==")


def lean_requirements(text: str, left_out: dict[str, str] | None = None) -> tuple[str, tuple[str, ...]]:
    """A hashed requirements file (``uv pip compile`` output) without the pins of ``left_out``
    (default ``LEFT_OUT``), and the ``name==version`` pins it removed.  A pin's continuation
    lines (``--hash=...``) and the ``# via`` comments under it go with it."""
    names = LEFT_OUT if left_out is None else left_out
    kept: list[str] = []
    removed: list[str] = []
    skipping = False
    for line in text.splitlines(keepends=True):
        m = _PIN_LINE.match(line)
        if m:
            skipping = canonical(m.group(1)) in names
            if skipping:
                removed.append(line.split(" ", 1)[0].split(";", 1)[0].strip().rstrip("\\").strip())
        elif line[:1] not in (" ", "\t"):
            skipping = False  # a top-level comment or option line ends a pin's block
        if not skipping:
            kept.append(line)
    return "".join(kept), tuple(removed)


# pynvml: vLLM's platform detection imports it to look for a GPU; it loads no CUDA library.
_KEPT_FROM_CUDA_CLOSURE = frozenset({"nvidia-ml-py"})
_CUDA_CLOSURE_PREFIXES = ("nvidia-", "cuda-")
_CUDA_CLOSURE_NAMES = frozenset({"torch", "triton", "torchvision", "torchaudio", "torchcodec", "xformers"})
CUDA_TORCH_REASON = "torch's CUDA build and what only it loads, replaced by a CPU build of torch (targets/lean.py)"


def in_cuda_torch_closure(name: str) -> bool:
    """Whether a distribution is torch's CUDA build, a CUDA library, triton, or an extension
    built against the CUDA torch: what a CPU torch replaces or cannot load."""
    name = canonical(name)
    if name in _KEPT_FROM_CUDA_CLOSURE:
        return False
    return name in _CUDA_CLOSURE_NAMES or name.startswith(_CUDA_CLOSURE_PREFIXES)


def cuda_torch_closure(text: str) -> dict[str, str]:
    """The names of a resolution's pins in ``in_cuda_torch_closure``, each with its reason."""
    names = (canonical(m.group(1)) for m in map(_PIN_LINE.match, text.splitlines()) if m)
    return {name: CUDA_TORCH_REASON for name in names if in_cuda_torch_closure(name)}


_CPU_TORCH = re.compile(r"^torch-(?P<version>[0-9][0-9.]*)\+cpu-(?P<py>cp[0-9]+)-(?P=py)-[A-Za-z0-9_.]+\.whl$")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def wheel_dirs(environ: dict[str, str] | None = None) -> tuple[Path, ...]:
    """Where a CPU torch wheel is looked for: ``$KVSPEC_TORCH_WHEELS`` (``os.pathsep``-separated),
    then pip's ``find-links`` (``$PIP_FIND_LINKS``, space-separated) where it is a local folder."""
    env = os.environ if environ is None else environ
    found = [*env.get("KVSPEC_TORCH_WHEELS", "").split(os.pathsep), *env.get("PIP_FIND_LINKS", "").split()]
    return tuple(Path(d.removeprefix("file://")) for d in found if d and "://" not in d.removeprefix("file://"))


def cpu_torch_wheel(pinned: str | None, python_tag: str, dirs: tuple[Path, ...] | None = None) -> Path | None:
    """A CPU build of torch for this Python (``python_tag``: ``cp311``), from ``wheel_dirs``:
    the release's own pin (``pinned``) where one lies there, else the newest; None if none does."""
    wheels: list[tuple[tuple[int, ...], Path]] = []
    for folder in wheel_dirs() if dirs is None else dirs:
        if folder.is_dir():
            for path in folder.iterdir():
                m = _CPU_TORCH.match(path.name)
                if m and m.group("py") == python_tag:
                    wheels.append((_version_key(m.group("version")), path))
    if not wheels:
        return None
    exact = [path for key, path in wheels if pinned is not None and key == _version_key(pinned)]
    return exact[0] if exact else max(wheels)[1]


# ------------------------------------------------------------------------------ pruned files
#
# Files inside kept distributions (issue 24). A venv beside a CPU torch still holds vLLM's own
# wheel whole, and most of its bytes are compiled CUDA extensions (0.33.0: 633 of 799 MiB; 0.12.0:
# 1,081 of 1,097 MiB). Each links torch's CUDA libraries (``DT_NEEDED`` libtorch_cuda.so /
# libc10_cuda.so, read from the file itself), which a CPU build of torch does not ship, so the
# dynamic loader cannot load it in that venv whatever vLLM's code asks; ``bench.lean_trace`` on
# ``kvspec check --vllm 0.33.0 / 0.12.0 --seed 1`` and the pinned-finding target tests mapped none
# of them. A venv that keeps torch's CUDA build (no CPU build of torch on the machine: vLLM's
# extensions load there and stay) instead holds CUDA libraries no shared object of it links --
# cuDNN's engine and op libraries, which libcudnn.so.9 dlopens for a cuDNN call on a GPU (973
# MiB), NVBLAS, cuSOLVER-Mg, CUPTI's profiler hosts -- and triton's GPU assembler tools; the trace
# of a default ``kvspec check --vllm 0.6.3`` mapped none of them. ``PRUNED_VLLM_FILES`` names what
# vLLM's wheel ships that no process kvspec drives executes or reads. These files are removed from
# the venv (``provision.prune_unloaded``) after their wheel's uv cache entry is detached from it
# (``disk.detach``): a venv hard-links uv's cache, so removing a venv's link alone would free
# nothing. The record lists each removed file (``kvspec-lock.json``, "pruned"); ``--full`` removes
# nothing.

# Shipped only by torch's CUDA build (torch/lib); a CPU build has neither.
CUDA_TORCH_SONAMES = frozenset({"libtorch_cuda.so", "libc10_cuda.so"})
UNLOADABLE_REASON = (
    "compiled CUDA extension linking {needs}, which a CPU build of torch does not ship: "
    "the loader cannot load it in this venv (targets/lean.py)"
)
# (pattern relative to site-packages, reason): what vLLM's wheel ships that no kvspec process runs.
PRUNED_VLLM_FILES: tuple[tuple[str, str], ...] = (
    (
        "vllm/vllm-rs",
        "vLLM's Rust serving front end, a program `vllm serve` starts (VLLM_RUST_FRONTEND_PATH); "
        "kvspec imports vLLM and starts no server",
    ),
    *(
        (
            f"vllm/**/*{suffix}",
            "C++/CUDA kernel source or header, read only by a CUDA compiler (DeepGEMM's and "
            "CUTLASS' kernel JIT on a GPU)",
        )
        for suffix in (".h", ".hpp", ".cuh", ".cu", ".inl")
    ),
)


def elf_needed(path: Path) -> tuple[str, ...] | None:
    """The ``DT_NEEDED`` entries of a 64-bit little-endian ELF file (the libraries the loader must
    find before the file loads); None if the file is not one or has no dynamic section."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
                return None
            (shoff,) = struct.unpack_from("<Q", head, 0x28)
            shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
            f.seek(shoff)
            table = f.read(shentsize * shnum)
            sections = [struct.unpack_from("<IIQQQQIIQQ", table, i * shentsize) for i in range(shnum)]
            for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
                if kind != 6:  # SHT_DYNAMIC
                    continue
                f.seek(offset)
                dynamic = f.read(size)
                strtab = sections[link]
                f.seek(strtab[4])
                strings = f.read(strtab[5])
                names = []
                for i in range(0, len(dynamic) - 15, entsize or 16):
                    tag, value = struct.unpack_from("<qQ", dynamic, i)
                    if tag == 0:  # DT_NULL
                        break
                    if tag == 1:  # DT_NEEDED
                        names.append(strings[value : strings.index(b"\0", value)].decode())
                return tuple(names)
    except (OSError, struct.error, IndexError, ValueError):
        return None
    return None


def has_cuda_torch(site: Path) -> bool:
    """Whether a site-packages holds any of ``CUDA_TORCH_SONAMES`` (torch's CUDA build)."""
    return any(next(site.glob(f"torch/lib/{name}*"), None) is not None for name in CUDA_TORCH_SONAMES)


# Beside torch's CUDA build (no CPU build of torch on the machine), what no process kvspec drives maps or runs.
CUDA_VENV_PRUNED_FILES: tuple[tuple[str, str], ...] = (
    (
        "triton/backends/nvidia/bin/*",
        "CUDA assembler and disassembler programs (ptxas, nvdisasm, cuobjdump) triton runs only "
        "when it compiles a kernel for a GPU",
    ),
)
UNLINKED_REASON = (
    "CUDA library no shared object of the venv outside nvidia/ links (DT_NEEDED, directly or "
    "through another CUDA library): loaded only by dlopen when its CUDA operation runs on a GPU "
    "(cuDNN's engine and op libraries, NVBLAS); never mapped by a default check (targets/lean.py)"
)


def _shared_objects(site: Path) -> list[Path]:
    return [p for p in site.rglob("*.so*") if p.is_file() and not p.is_symlink() and ".so" in p.name]


def unlinked_cuda_libraries(site: Path) -> list[Path]:
    """The files under ``nvidia/*/lib`` that no shared object of the venv outside ``nvidia/``
    needs, directly or through other CUDA libraries: what the dynamic loader never maps when torch
    and vLLM load, and only a ``dlopen`` by name on a GPU does."""
    objects = _shared_objects(site)
    cuda = [p for p in objects if p.relative_to(site).parts[0] == "nvidia"]
    by_name: dict[str, list[Path]] = {}
    for path in cuda:
        by_name.setdefault(path.name, []).append(path)
    linked: set[Path] = set()
    todo = [p for p in objects if p.relative_to(site).parts[0] != "nvidia"]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in elf_needed(path) or ():
            for lib in by_name.get(name, ()):
                linked.add(lib)
                todo.append(lib)
    return sorted(p for p in cuda if p not in linked and elf_needed(p) is not None)


# Files of distributions that releases share (torch, numpy, scipy, sympy, ray, ...: one unpacked
# wheel in uv's cache serves every venv that pins the same version), which no kvspec process
# imports, maps, opens or starts: ``bench.lean_trace`` (modules, ``/proc/self/maps``, and the files
# Python opens and the programs it starts, by audit hook) on ``kvspec check --vllm 0.12.0 --seed
# 1`` and the pinned-finding target tests touched none of them but numpy's ``_natype`` (kept:
# ``numpy.testing`` imports it).  Matched against the path inside
# site-packages (the same as inside the wheel).  Unlike vLLM's own wheel, whose cache entry only
# its release uses, these are removed from the shared cache entry itself (``provision.prune_unloaded``),
# so that the next release linking it neither holds them nor unpacks the wheel again; a ``--full``
# provisioning first discards such trimmed entries (``disk.trimmed_entries``) so that its venv is whole.
_TEST_SUITES = ("numpy", "scipy", "sympy", "networkx", "mpmath", "setuptools", "pkg_resources", "supervisor", "psutil")
TRIMMED_SHARED_FILES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), reason)
    for pattern, reason in (
        (
            r"torch/include/.+|torch/share/cmake/.+|torch/lib/[^/]+\.a",
            "torch's C++ headers, CMake package files and static libraries, read only when a C++ "
            "extension or an inductor C++ kernel is compiled (torch.utils.cpp_extension, torch.compile); "
            "kvspec compiles none",
        ),
        (
            r"torch/test/[^/]+|torch/bin/(?:test_[^/]+|[A-Za-z]+Test|protoc(?:-[0-9.]+)?)",
            "torch's C++ test programs (gtest binaries of its own build) and the protobuf compiler, "
            "programs nothing in Python starts",
        ),
        (
            # numpy.testing imports numpy._core.tests._natype (pd_NA), which stays
            rf"(?!numpy/_?core/tests/(?:__pycache__/)?_natype\.)(?:{'|'.join(_TEST_SUITES)})/(?:[^/]+/)*tests/.+",
            "a distribution's own test suite, imported only by its test runner (pytest, numpy.test())",
        ),
        (
            r"ray/core/src/ray/(?:raylet/raylet|gcs/gcs_server)|ray/jars/.+|ray/dashboard/client/build/.+",
            "ray's node programs (raylet, GCS server) that ray.init() or `ray start` launches, its Java "
            "workers' classes and its dashboard's web client; vLLM imports ray, kvspec starts no ray cluster",
        ),
    )
)
_TRIMMED_TOPS = frozenset({"torch", "ray", *_TEST_SUITES})


def trimmed_reason(relative: str) -> str | None:
    """The reason a file of a shared distribution (its path inside site-packages, ``/``-separated)
    is removed (``TRIMMED_SHARED_FILES``), or None if it is kept."""
    for pattern, reason in TRIMMED_SHARED_FILES:
        if pattern.fullmatch(relative):
            return f"{reason} (targets/lean.py)"
    return None


def _trimmed_files(site: Path) -> list[tuple[Path, str]]:
    found = []
    for top in sorted(_TRIMMED_TOPS):
        for folder, _dirs, names in os.walk(site / top):
            for name in names:
                path = Path(folder, name)
                reason = trimmed_reason(path.relative_to(site).as_posix())
                if reason is not None and not path.is_symlink():
                    found.append((path, reason))
    return found


def prunable_files(site: Path) -> list[tuple[Path, str]]:
    """The files of a lean venv's distributions that no kvspec process loads, each with its reason:
    beside a CPU torch, vLLM's extensions needing torch's CUDA libraries; beside torch's CUDA build,
    the CUDA libraries nothing links and triton's GPU tools; either way ``PRUNED_VLLM_FILES`` and
    ``TRIMMED_SHARED_FILES``."""
    found: dict[Path, str] = {}
    cuda_torch = has_cuda_torch(site)
    if (site / "vllm").is_dir() and not cuda_torch:
        for path in sorted((site / "vllm").rglob("*.so")):
            needs = sorted(CUDA_TORCH_SONAMES & set(elf_needed(path) or ()))
            if needs and not path.is_symlink():
                found[path] = UNLOADABLE_REASON.format(needs=", ".join(needs))
    if cuda_torch and (site / "nvidia").is_dir():
        found.update((path, UNLINKED_REASON) for path in unlinked_cuda_libraries(site))
    patterns = [*PRUNED_VLLM_FILES, *(CUDA_VENV_PRUNED_FILES if cuda_torch else ())]
    for pattern, reason in patterns:
        for path in sorted(site.glob(pattern)):
            if path.is_file() and not path.is_symlink():
                found.setdefault(path, f"{reason} (targets/lean.py)")
    for path, reason in _trimmed_files(site):
        found.setdefault(path, reason)
    return sorted(found.items())
