"""The registry's release facts (``kvspec.targets.registry.SHIPPED``) against the release this
venv holds: the legacy managers its ``BlockSpaceManager.get_block_space_manager_class`` builds
are exactly the ones the registry lists, and every module the registry names imports."""

from __future__ import annotations

import importlib
import importlib.util

from kvspec.adapters import legacy
from kvspec.targets.provision import release_modules
from kvspec.targets.registry import shipped
from kvspec.testing.implementations import by_manager

from .conftest import VLLM, requires_vllm


@requires_vllm("0.4.3", pin="0.6.3")
def test_legacy_managers_are_the_registry_s():
    assert VLLM is not None
    if not shipped(VLLM, "legacy"):
        assert importlib.util.find_spec("vllm.core") is None, (
            f"vLLM {VLLM} ships vllm/core but the registry lists no legacy manager for it"
        )
        return
    found = tuple(by_manager(m).name for m in legacy.available_managers())
    assert sorted(found) == sorted(shipped(VLLM, "legacy")), f"vLLM {VLLM}"


@requires_vllm("0.4.3", pin="0.6.3")
def test_every_registered_module_imports():
    assert VLLM is not None
    for name in release_modules(VLLM):
        importlib.import_module(name)
