"""Reachable-but-missed mutants: a few short straight-line scenarios run over mutants.

The mutation oracle (``bench.mutation``) draws its operations at random; a mutant it does not
kill may still be killable by a short, plain sequence, e.g. admitting and freeing one
block-aligned prompt three times.  This runs such scenarios through the
Driver (every invariant checked after every operation) on each given mutant, in a forked
child of a server that has imported torch and vLLM once (the same import hook as the
mutation run), and lists the mutants some scenario kills.  Those are the ones a search
*could* kill: the search evidence (``--seeds`` of ``python -m bench mutate``) measures
whether the default and the swarm search do.

``python -m bench _worker reach PARAMS OUT`` is started by ``python -m bench mutate --reach``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

# (block_size, num_blocks, prompt blocks, rounds): a block-aligned prompt admitted and freed
# ``rounds`` times in a pool that holds it, with room to spare and exactly.
CHILD_SECONDS = 60
SHAPES = [(b, n, k, 3) for b in (1, 2, 4) for (n, k) in ((4, 2), (8, 3), (3, 3), (16, 4))]


def scenarios(make, config_cls) -> list[str]:
    """Run every scenario; the first violation or crash of each, as text."""
    from kvspec.testing.blockmanager.driver import Driver

    found: list[str] = []
    for block_size, blocks, prompt_blocks, rounds in SHAPES:
        for caching in (True,):
            config = config_cls(block_size=block_size, num_blocks=blocks, prefix_caching=caching)
            tokens = tuple(range(1, block_size * prompt_blocks + 1))
            label = (f"B={block_size} pool={blocks} prompt={len(tokens)} tokens "
                     f"caching={'on' if caching else 'off'}")
            try:
                driver = Driver(make(config))
                for r in range(rounds):
                    driver.admit(r, tokens, len(tokens))
                    problems = driver.check()
                    if not problems:
                        driver.free(r)
                        problems = driver.check()
                    if problems:
                        found.append(f"{label}, round {r + 1}: {problems[0]}")
                        break
            except Exception as error:  # a crash of the mutated target
                found.append(f"{label}: crash {type(error).__name__}: {error}"[:300])
    return found


def run(p: dict[str, Any]) -> dict[str, Any]:
    """Fork server: one child per mutant key; returns {key: [what killed it]}."""
    from .import_hook import check_loaded, install

    for name in p["preimport"]:
        __import__(name)
    import kvspec.testing  # noqa: F401

    out: dict[str, Any] = {}
    for job in p["jobs"]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            code = 0
            try:
                signal.alarm(CHILD_SECONDS)  # a mutant that hangs: the default action ends it
                sys.stdout = sys.stderr = open(os.devnull, "w")
                mutation = None if job["site"] is None else job
                install(p["paths"], mutation)
                from kvspec.spec.config import Config

                from .common import factory

                make = factory("v1")
                text = json.dumps(scenarios(make, Config))
                check_loaded(p["paths"])
            except BaseException as error:  # the mutated module does not import or build
                text = json.dumps([f"import/build crash {type(error).__name__}: {error}"[:300]])
                code = 1
            os.write(write, text.encode())
            os.close(write)
            os._exit(code)
        os.close(write)
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if os.WIFSIGNALED(status):
            out[job["key"]] = [f"timeout: no answer within {CHILD_SECONDS} s"]
        else:
            out[job["key"]] = json.loads(b"".join(chunks) or b"[]")
    return out


def main(params_file: str, out: str) -> None:
    p = json.loads(Path(params_file).read_text())
    Path(out).write_text(json.dumps(run(p)))
