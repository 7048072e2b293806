"""What a lean target venv leaves out of a release's dated resolution, and why that is safe.

A release's resolution installs what vLLM needs to serve a model on a GPU: attention and GEMM
kernels, kernel compilers, CUDA toolkit pieces, serving and tool-calling clients.  kvspec
imports only vLLM's block managers and its V1 scheduler, on the CPU.  A lean venv is the same
dated, hashed resolution minus the distributions in ``LEFT_OUT``; ``kvspec provision --full``
installs all of it.

How the list was made (``python -m bench.lean_trace``; BENCHMARKS.md, "Lean targets", has the
commands and figures): every process of ``kvspec check --vllm 0.33.0 --examples 20``, of the
in-target suite ``tests/targets`` on 0.33.0, and of ``kvspec check --vllm 0.6.3 --impl
legacy-v2`` / ``legacy-v1`` ran in the full venvs with a ``sitecustomize`` that wrote, at exit,
the file of every module in ``sys.modules`` and every shared object in ``/proc/self/maps``;
each file was mapped to its distribution by the distributions' RECORDs.  A name is listed only
when no file of it was loaded on any traced release that installs it.  Then the same checks
(same seeds: the same verdicts and counts) and ``tests/targets`` ran in the lean venvs.

Distributions that were loaded stay even when vLLM tolerates their absence
(triton: vLLM imports it when present; ray and mistral-common: 0.6.3 imports them;
fastsafetensors: 0.33.0's weight_utils.py imports it under tests/targets), because leaving
them out changes which code vLLM runs.  Loaded CUDA libraries (libcublas, libcudnn,
... which libtorch_cuda.so links) stay too.

The list is applied by name to any release: a name a release does not install is ignored.  A
lean venv whose block managers or scheduler do not import is made full instead (provision.py).
"""

from __future__ import annotations

import re

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
            "media decoding, model loading and serving-side clients",
            (
                "pynvvideocodec",
                "instanttensor",
                "hf-xet",
                # not pycountry: the HF processors of multimodal models import it (transformers
                # 5.x, vLLM 0.25.1+), and the scheduler's multimodal shape builds one
                # (MultiModalBudget, adapters/v1_scheduler_mm.py)
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
