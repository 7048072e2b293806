"""The one table of implementations: every name the CLI, the benchmarks, the reproducer and the
target tests use resolves through ``kvspec.testing.implementations``."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from kvspec.adapters.legacy import MANAGERS
from kvspec.reference import ReferenceManager
from kvspec.reference.broken import BROKEN
from kvspec.spec.config import Config
from kvspec.targets.registry import PINNED, SHIPPED, target
from kvspec.testing import implementations as impls

REPO = Path(__file__).resolve().parent.parent


def test_every_kvspec_implementation_builds():
    config = Config(block_size=2, num_blocks=4)
    for name in ["reference", *(impls.BROKEN_PREFIX + v for v in BROKEN)]:
        assert impls.factory(name)(config).config == config, name
    assert impls.factory("reference") is ReferenceManager
    assert not any(impls.lookup(n).is_vllm for n in impls.names() if n.startswith(impls.BROKEN_PREFIX))


def test_legacy_names_are_the_adapters_managers():
    legacy = [i for i in impls.VLLM if i.engine == "legacy"]
    assert sorted(i.manager for i in legacy) == sorted(MANAGERS)
    for impl in legacy:
        assert isinstance(impl.factory, functools.partial)
        assert impl.factory.keywords == {"manager": impl.manager}
        assert impls.by_manager(impl.manager) is impl


@pytest.mark.parametrize("name", ["legacy-v1", "legacy-v2", "legacy-self-attn", "v1", "reference"])
def test_the_benchmarks_build_what_the_cli_builds(name):
    sys.path.insert(0, str(REPO))  # bench/ is a folder of the checkout, not an installed package
    from bench import common

    assert common.factory(name) == impls.factory(name)


@pytest.mark.parametrize("version", PINNED)
def test_every_manager_a_release_ships_is_in_the_table(version):
    t = target(version)
    for name in t.managers:
        assert impls.lookup(name).engine == t.engine, (version, name)


def test_the_release_table_names_the_same_implementations():
    """targets.registry.SHIPPED says which releases ship each vLLM manager; this table says how
    to build it.  Both key on the same names with the same engine."""
    shipped = {s.impl: s.engine for s in SHIPPED}
    assert shipped == {i.name: i.engine for i in impls.VLLM}


def test_unknown_names_say_what_exists():
    with pytest.raises(impls.UnknownImplementation, match="legacy-self-attn"):
        impls.lookup("self-attn")
    with pytest.raises(impls.UnknownImplementation, match="leak-on-free"):
        impls.lookup("broken:nope")
