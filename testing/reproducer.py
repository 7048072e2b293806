"""Standalone reproducers: a pytest file that imports only vllm and pytest, builds the block
manager exactly as kvspec's adapter does, replays a recorded trace with the calls the adapter
makes (in the order vLLM's scheduler makes them), and fails naming the invariant with the
expected and the observed values.

Pure text generation: this module imports neither vllm nor the adapters.  The generated
harness mirrors ``adapters/legacy.py`` (legacy BlockSpaceManagerV1/V2/SelfAttn) and
``adapters/v1.py`` (V1 ``KVCacheManager``) together with the scheduler model of
``testing/driver.py``; ``kvspec check`` runs every reproducer it writes against the target
and keeps it only when it fails there naming the invariant, so a harness that drifted from
the adapters shows up as "not reproducible", never as a wrong file.

What a standalone file can check (``SUPPORTED``): the count-based invariants, read off the
manager's own data structures, plus admission soundness and the copy-on-write half of
immutability.  The properties that need kvspec's shadow KV memory (``kv-readback``,
``prefix-cache-consistency``, and overwrites within a block's lifetime) are not reproduced
standalone; the JSON report and ``kvspec replay`` cover them.
"""

from __future__ import annotations

import pprint
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from kvspec.spec.config import Config
from kvspec.spec.invariants import INVARIANTS, Violation
from kvspec.spec.kv_memory import SHARED_WRITE

from .driver import TraceStep
from .implementations import VLLM

# Invariants each harness can check standalone.
SUPPORTED: dict[str, frozenset[str]] = {
    "legacy": frozenset(
        {
            "admission-soundness",
            "window-bound",
            "no-leak",
            "refcount-exact",
            "conservation",
            "immutability",
        }
    ),
    "v1": frozenset(
        {
            "admission-soundness",
            "window-bound",
            "no-leak",
            "refcount-exact",
            "conservation",
            "immutability",
        }
    ),
}

LEGACY_MANAGERS = {i.name: i.manager for i in VLLM if i.harness == "legacy"}


@attrs.frozen
class Reproducer:
    filename: str
    text: str
    checks: tuple[str, ...]


@attrs.frozen
class NotReproducible:
    reason: str


def _only_cow_immutability(violations: Sequence[Violation]) -> bool:
    """The harness checks the copy-on-write half of immutability (a write into a block shared
    by several slots); overwrites within a block's life need the shadow memory."""
    return any(v.invariant == "immutability" and v.kind == SHARED_WRITE for v in violations)


def generate(
    impl: str,
    config: Config,
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    meta: Mapping[str, Any],
) -> Reproducer | NotReproducible:
    """A standalone reproducer for a violation found on ``impl`` (a kvspec impl name)."""
    if impl in LEGACY_MANAGERS:
        return _straight_line(impl, config, trace, violations, meta)
    if impl == "v1":
        made = _straight_line(impl, config, trace, violations, meta)
        if isinstance(made, Reproducer):
            return made
        # Not recordable as literals (e.g. multimodal feature objects): the trace interpreter.
        if any(s.op == "admit" and s.args.get("extra") for s in trace):
            return NotReproducible(
                "the trace interpreter builds plain requests only (no cache salt, LoRA adapter "
                "or multimodal placement); use the JSON report with `kvspec replay`"
            )
        family, template = "v1", _V1
    else:
        return NotReproducible(
            f"{impl} is not a vLLM block manager: standalone reproducers target vLLM only"
        )
    if not violations:
        return NotReproducible("no invariant was violated (the run crashed instead)")
    violated = list(dict.fromkeys(v.invariant for v in violations))
    checks = [i for i in violated if i in SUPPORTED[family]]
    if "immutability" in checks and not _only_cow_immutability(violations):
        checks.remove("immutability")
    if not checks:
        return NotReproducible(
            f"{', '.join(violated)} needs kvspec's shadow KV memory model (what the worker "
            "wrote into each slot), which a file importing only vllm cannot carry; use the "
            "JSON report with `kvspec replay`"
        )
    trace_json = [s.to_json() for s in trace]
    first = checks[0]
    inv = INVARIANTS[first]
    header = _header(impl, config, trace, violations, meta, checks)
    replacements = {
        "%%HEADER%%": header,
        "%%MANAGER%%": repr(LEGACY_MANAGERS.get(impl, "v1")),
        "%%CONFIG%%": pprint.pformat(attrs.asdict(config), sort_dicts=False, width=90),
        "%%CHECKS%%": repr(tuple(checks)),
        "%%TRACE%%": _format_trace(trace_json),
        "%%TEST%%": "test_" + re.sub(r"\W", "_", first.replace("-", "_")),
        "%%INVARIANT%%": inv.id,
    }
    text = template
    for key, value in replacements.items():
        text = text.replace(key, value)
    name = f"test_kvspec_{re.sub(r'[^a-z0-9]+', '_', impl)}_{first.replace('-', '_')}.py"
    return Reproducer(name, text, tuple(checks))


def _straight_line(
    impl: str,
    config: Config,
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    meta: Mapping[str, Any],
) -> Reproducer | NotReproducible:
    """The reproducer as the adapter's own calls, recorded (``straight_line``).

    The replay watches what the run watched (``meta["focus"]``; a crash found under a focus
    may lie behind violations of invariants the run did not watch), else the violated ones."""
    from kvspec.adapters.recording import Unrecordable

    from . import straight_line

    def build(recorder):
        if impl == "v1":
            from kvspec.adapters.v1 import VLLMV1Adapter

            return VLLMV1Adapter(config, recorder=recorder)
        from kvspec.adapters.legacy import LegacyAdapter

        return LegacyAdapter(config, manager=LEGACY_MANAGERS[impl], recorder=recorder)

    try:
        focus = meta.get("focus")
        if focus is None and violations:
            focus = sorted({v.invariant for v in violations})
        engine = "v1" if impl == "v1" else "legacy"
        recording = straight_line.record(build, trace, focus, engine)
        title = f"kvspec reproducer on {straight_line.describe_target(meta, impl)}:"
        text, checks = straight_line.write(recording, trace, title=title, config=config)
    except (straight_line.NotStraightLine, Unrecordable) as why:
        return NotReproducible(str(why))
    except ModuleNotFoundError as err:
        return NotReproducible(f"writing it replays the trace on vLLM, which does not import here ({err})")
    name = f"test_kvspec_{re.sub(r'[^a-z0-9]+', '_', impl)}_{checks[0].replace('-', '_')}.py"
    return Reproducer(name, text, checks)


def _format_trace(trace_json: list[dict[str, Any]]) -> str:
    lines = ["["]
    for step in trace_json:
        text = pprint.pformat(step, width=92, sort_dicts=False)
        lines.append("    " + text.replace("\n", "\n    ") + ",")
    lines.append("]")
    return "\n".join(lines)


def _header(
    impl: str,
    config: Config,
    trace: Sequence[TraceStep],
    violations: Sequence[Violation],
    meta: Mapping[str, Any],
    checks: Sequence[str],
) -> str:
    def wrap(text: str, indent: str) -> list[str]:
        return textwrap.wrap(text, 92, initial_indent=indent, subsequent_indent=indent, break_long_words=False)

    lines = [
        f"kvspec reproducer: {checks[0]} on vLLM {meta.get('vllm_version', '?')} ({impl}).",
        "",
        f"Generated by kvspec {meta.get('kvspec_version', '')}; it imports only vllm and pytest.",
        "It builds the block manager as kvspec's adapter does and replays the trace below with",
        "the calls vLLM's scheduler makes, then fails naming the invariant with the expected and",
        "the observed values.  Run it with plain pytest where vllm imports:",
        "",
        "    python -m pytest -q THIS_FILE",
        "",
        "It fails while the bug is present and passes once it is fixed.",
        "",
    ]
    for inv_id in checks:
        inv = INVARIANTS[inv_id]
        lines.append(f"{inv.id} -- {inv.title}:")
        lines.extend(wrap(inv.statement, "    "))
    lines.append("")
    lines.append(f"Configuration: {config.describe()}")
    lines.append("")
    lines.append("What kvspec observed:")
    for v in violations:
        lines.extend(wrap(str(v), "    "))
    lines.append("")
    lines.append("The trace (one scheduler operation per line, with the target's answer):")
    for i, s in enumerate(trace, 1):
        lines.extend(wrap(f"{i}. {s.describe()}", "    "))
    text = "\n".join(lines)
    return text.replace('"""', "'''").replace("\\", "\\\\")


# ---------------------------------------------------------------------------------------------
# The V1-engine harness (vllm/v1/core KVCacheManager), mirroring adapters/v1.py.

_V1 = r'''"""%%HEADER%%
"""

import dataclasses
import importlib
import importlib.util
import inspect
import itertools

import pytest

MANAGER = %%MANAGER%%
CONFIG = %%CONFIG%%
CHECKS = %%CHECKS%%
TRACE = %%TRACE%%

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
kcm = importlib.import_module("vllm.v1.core.kv_cache_manager")
kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
kci = importlib.import_module("vllm.v1.kv_cache_interface")
vrequest = importlib.import_module("vllm.v1.request")
vsampling = importlib.import_module("vllm.sampling_params")
vconfig = importlib.import_module("vllm.config")

MAX_MODEL_LEN = 8192


def _params(fn):
    return dict(inspect.signature(fn).parameters)


def _build(cls, **candidates):
    """Construct passing only the keyword arguments the release accepts."""
    params = _params(cls.__init__) if inspect.isclass(cls) else _params(cls)
    kwargs = {k: v for k, v in candidates.items() if k in params}
    missing = [n for n, p in params.items() if n != "self" and p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in kwargs]
    if missing:
        pytest.skip(f"{cls.__name__} of this vLLM needs {missing}: the reproducer predates it")
    return cls(**kwargs)


def _config_default(cls, name, fallback):
    try:
        for field in dataclasses.fields(cls):
            if field.name == name:
                return field.default if field.default is not dataclasses.MISSING else fallback
        return fallback
    except TypeError:
        pass
    param = _params(cls.__init__).get(name)
    return fallback if param is None or param.default is param.empty else param.default


def fail(invariant, message):
    pytest.fail(f"[{invariant}] {message}", pytrace=False)


def hash_fn_by_name(name):
    for mod in ("vllm.utils.hashing", "vllm.utils"):
        try:
            fn = getattr(importlib.import_module(mod), "get_hash_fn_by_name", None)
        except ImportError:
            continue
        if fn is not None:
            return fn(name)
    pytest.skip("this vLLM has no get_hash_fn_by_name")


def scheduler_admits_lookahead(alloc_params):
    """Whether this release's scheduler passes the lookahead when it admits a request (read
    off the scheduler source, as kvspec's adapter does)."""
    if "num_lookahead_tokens" not in alloc_params:
        return False
    spec = importlib.util.find_spec("vllm.v1.core.sched.scheduler")
    if spec is None or spec.origin is None:
        return False
    with open(spec.origin, encoding="utf-8") as f:
        src = f.read()
    for call in src.split("allocate_slots(")[1:]:
        call = call[: call.find("\n\n")]
        if "new_computed_blocks" not in call:
            continue
        if "num_lookahead_tokens=" not in call:
            return False
        value = call.split("num_lookahead_tokens=", 1)[1].split(",", 1)[0].strip()
        if value == "self.num_lookahead_tokens":
            return True
        start = src.find(f"{value} =")
        if start < 0:
            return False
        return "num_computed_tokens" not in src[start : src.find("\n\n", start)]
    return False


class Replay:
    """The V1 scheduler, as kvspec's driver models it, over one KVCacheManager."""

    def __init__(self):
        c = CONFIG
        B = self.B = c["block_size"]
        self.window = c["sliding_window"]
        self.alloc_params = _params(kcm.KVCacheManager.allocate_slots)
        common = dict(block_size=B, num_kv_heads=1, head_size=64, dtype=torch.float16,
                      use_mla=False)
        if self.window is None:
            spec = _build(kci.FullAttentionSpec, **common)
        else:
            spec = _build(kci.SlidingWindowSpec, sliding_window=self.window, **common)
        group = _build(kci.KVCacheGroupSpec, layer_names=["model.layers.0.attn"],
                       kv_cache_spec=spec)
        # +1: block 0 is vLLM's null block, not a pool block.
        kv_cache_config = _build(kci.KVCacheConfig, num_blocks=c["num_blocks"] + 1, tensors={},
                                 kv_cache_tensors=[], kv_cache_groups=[group])
        algo = _config_default(vconfig.CacheConfig, "prefix_caching_hash_algo", "builtin")
        self.block_hasher = None
        if c["prefix_caching"] and hasattr(kcu, "get_request_block_hasher"):
            fn = hash_fn_by_name(algo)
            if hasattr(kcu, "init_none_hash"):
                kcu.init_none_hash(fn)
            self.block_hasher = _build(kcu.get_request_block_hasher, block_size=B,
                                       hash_block_size=B, caching_hash_fn=fn)
        self.mgr = _build(kcm.KVCacheManager, kv_cache_config=kv_cache_config,
                          max_model_len=MAX_MODEL_LEN, enable_caching=c["prefix_caching"],
                          caching_hash_algo=algo, use_eagle=False, log_stats=False,
                          enable_kv_cache_events=False, scheduler_block_size=B,
                          hash_block_size=B, max_in_flight_tokens=None, pcp_world_size=1)
        full = bool(_config_default(vconfig.SchedulerConfig, "scheduler_reserve_full_isl", False))
        self.full_sequence_must_fit = full and "full_sequence_must_fit" in self.alloc_params
        has_lookahead = "num_lookahead_tokens" in self.alloc_params
        self.lookahead = c["max_lookahead"] if has_lookahead else 0
        self.admit_lookahead = (c["max_lookahead"] if scheduler_admits_lookahead(self.alloc_params)
                                else 0)
        self.live, self.parked, self.pending = {}, {}, {}
        self.model = {}
        self.memory = {}  # (block, offset) -> (position, token): tells a recompute apart
        self.ids = itertools.count()

    def alloc(self, request, num_new, **kw):
        args = {k: v for k, v in kw.items() if k in self.alloc_params}
        return self.mgr.allocate_slots(request, num_new, **args)

    def new_request(self, sid, tokens):
        return _build(vrequest.Request, request_id=f"seq{sid}-{next(self.ids)}", prompt=None,
                      prompt_token_ids=list(tokens), multi_modal_inputs=None,
                      multi_modal_kwargs=None, multi_modal_hashes=None,
                      multi_modal_placeholders=None, mm_features=None,
                      sampling_params=vsampling.SamplingParams(max_tokens=MAX_MODEL_LEN),
                      pooling_params=None, eos_token_id=None, arrival_time=0.0,
                      lora_request=None, cache_salt=None, block_hasher=self.block_hasher)

    def drain_copies(self):
        if not hasattr(self.mgr, "take_kv_cache_block_copies"):
            return []
        copies, retained = self.mgr.take_kv_cache_block_copies()
        if retained:
            self.mgr.block_pool.free_blocks(retained)
        return [(c.src_block_id, c.dst_block_id) for c in copies]

    def scheduled(self, sid, request, n):
        request.num_computed_tokens += n
        if hasattr(request, "num_in_flight_tokens"):
            request.num_in_flight_tokens += n
        self.pending[sid] = self.pending.get(sid, 0) + n

    def snapshot(self):
        view = self.observe()
        return (sorted(view["refcounts"].items()), len(view["free"]) + len(view["evictable"]),
                sorted((s, tuple(t)) for s, t in view["tables"].items()))

    def admit(self, sid, tokens, k, next_token):
        request = self.parked.pop(sid, None)
        if request is not None and tuple(request.all_token_ids) != tuple(tokens):
            if hasattr(self.mgr, "free_block_hashes"):
                self.mgr.free_block_hashes(request)
            request = None
        if request is None:
            request = self.new_request(sid, tokens)
        computed = self.mgr.get_computed_blocks(request)
        blocks, hit = computed[0], computed[1]
        if len(computed) > 2 and hasattr(request, "shared_prefix_boundary"):
            request.shared_prefix_boundary = computed[2]
        num_new = min(k, len(tokens) - hit)
        kw = dict(num_new_computed_tokens=hit, new_computed_blocks=blocks,
                  num_lookahead_tokens=self.admit_lookahead, has_scheduled_reqs=bool(self.live))
        if self.full_sequence_must_fit:
            kw["full_sequence_must_fit"] = True
        before = self.snapshot()
        if self.alloc(request, num_new, **kw) is None:
            self.parked[sid] = request
            self.refused(f"seq {sid}: allocate_slots refused the admission", before)
            return False
        request.status = vrequest.RequestStatus.RUNNING
        request.num_computed_tokens = hit
        self.scheduled(sid, request, num_new)
        self.live[sid] = request
        self.copy(self.drain_copies())
        end = min(hit + max(1, k), len(tokens))
        self.model[sid] = {"tokens": list(tokens), "computed": hit, "status": "running",
                           "step": (hit, end + self.lookahead)}
        self.compute(sid, hit, end, next_token)
        return True

    def refused(self, what, before):
        """A refusal may release only slots the sliding window no longer needs."""
        if "admission-soundness" not in CHECKS:
            return
        after = self.snapshot()
        if after == before or self.window is not None:
            return
        fail("admission-soundness",
             f"{what}: expected the refused allocation to leave the state unchanged, observed "
             f"free blocks {before[1]} -> {after[1]}")

    def step(self, sid, k, next_token):
        m = self.model[sid]
        start = m["computed"]
        k = max(1, min(k, len(m["tokens"]) - start))
        request = self.live[sid]
        before = self.snapshot()
        if self.alloc(request, k, num_lookahead_tokens=self.lookahead) is None:
            self.refused(f"seq {sid}: allocate_slots refused {k}+{self.lookahead} slots", before)
            return False
        self.scheduled(sid, request, k)
        self.copy(self.drain_copies())
        m["step"] = (start, max(start + k + self.lookahead, m["step"][1]))
        self.compute(sid, start, start + k, next_token)
        return True

    def copy(self, pairs):
        for a, b in pairs:
            for off in range(self.B):
                if (a, off) in self.memory:
                    self.memory[(b, off)] = self.memory[(a, off)]

    def compute(self, sid, start, end, next_token):
        request = self.live[sid]
        m = self.model[sid]
        view = self.observe()
        table = view["tables"].get(sid, [])
        for pos in range(start, end):
            i = pos // self.B
            block = table[i] if i < len(table) else None
            if block is None:
                continue
            cell, kv = (block, pos % self.B), (pos, m["tokens"][pos])
            if self.memory.get(cell) == kv:
                continue  # a recompute writes the very KV the slot holds
            self.memory[cell] = kv
            if "immutability" in CHECKS and view["refcounts"].get(block, 0) > 1:
                fail("immutability",
                     f"seq {sid} writes position {pos} into block {block}: expected a "
                     f"private block, observed it shared by {view['refcounts'][block]} "
                     f"block-table slots")
        if end > start:
            self.pending[sid] = self.pending.get(sid, 0) - (end - start)
            if hasattr(request, "num_in_flight_tokens"):
                request.num_in_flight_tokens -= end - start
        m["computed"] = end
        if end == len(m["tokens"]):
            request.append_output_token_ids(next_token)
            m["tokens"].append(next_token)

    def release(self, sid):
        request = self.live.pop(sid)
        self.mgr.free(request)
        request.status = vrequest.RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if hasattr(request, "num_in_flight_tokens"):
            request.num_in_flight_tokens = 0
        if hasattr(request, "num_preemptions"):
            request.num_preemptions += 1
        if getattr(request, "spec_token_ids", None):
            request.spec_token_ids = []
        self.pending.pop(sid, None)
        self.parked[sid] = request

    def free(self, sid):
        if self.model[sid]["status"] != "waiting":
            self.release(sid)
        del self.model[sid]

    def preempt(self, sid):
        self.release(sid)
        self.model[sid].update(status="waiting", computed=0, step=(0, 0))

    def apply(self, step):
        op, a = step["op"], step["args"]
        if op == "admit":
            self.admit(a["seq"], a["tokens"], a["num_new_tokens"], a.get("next_token", 0))
        elif op == "readmit":
            m = self.model[a["seq"]]
            self.admit(a["seq"], m["tokens"], a["num_new_tokens"], a.get("next_token", 0))
        elif op == "step":
            self.step(a["seq"], a["num_new_tokens"], a.get("next_token", 0))
        elif op == "reset_prefix_cache":
            self.mgr.reset_prefix_cache()
        elif op in ("free", "preempt"):
            getattr(self, op)(a["seq"])
        else:
            pytest.skip(f"the V1 engine has no {op}")

    def free_all(self):
        for sid in sorted(self.model):
            self.free(sid)

    # ---------------------------------------------------------------- observation

    def group_blocks(self, request_id):
        m = self.mgr
        if hasattr(m, "coordinator"):
            return list(m.coordinator.get_blocks(request_id)[0])
        if hasattr(m, "single_type_manager"):
            return list(m.single_type_manager.req_to_blocks.get(request_id, []))
        return list(m.req_to_blocks.get(request_id, []))

    def observe(self):
        pool = self.mgr.block_pool
        null = pool.null_block
        blocks = [b for b in pool.blocks if b is not null]
        queue = pool.free_block_queue
        if hasattr(queue, "get_all_free_blocks"):
            free_blocks = list(queue.get_all_free_blocks())
        else:
            free_blocks, b = [], queue.free_list_head
            while b is not None:
                free_blocks.append(b)
                b = b.next_free_block
        tables = {}
        for sid, request in self.live.items():
            tables[sid] = [None if (b is null or getattr(b, "is_null", False)) else b.block_id
                           for b in self.group_blocks(request.request_id)]
        return {"ids": [b.block_id for b in blocks],
                "refcounts": {b.block_id: b.ref_cnt for b in blocks},
                "free": [b.block_id for b in free_blocks if b.block_hash is None],
                "evictable": [b.block_id for b in free_blocks if b.block_hash is not None],
                "tables": tables}

    def check(self, where):
        view = self.observe()
        held = {sid: [b for b in t if b is not None] for sid, t in view["tables"].items()}
        if "refcount-exact" in CHECKS:
            holders = {}
            for blocks in held.values():
                for b in blocks:
                    holders[b] = holders.get(b, 0) + 1
            for b in sorted(set(holders) | set(view["refcounts"])):
                want, got = holders.get(b, 0), view["refcounts"].get(b)
                if got != want:
                    fail("refcount-exact",
                         f"{where}: block {b}: expected refcount {want} (the live "
                         f"block-table slots holding it), observed {got}")
        if "conservation" in CHECKS:
            free, evictable = view["free"], set(view["evictable"])
            in_use = {b for b, rc in view["refcounts"].items() if rc > 0}
            dup = sorted({b for b in free if free.count(b) > 1})
            lost = sorted(set(view["ids"]) - set(free) - evictable - in_use)
            both = sorted((set(free) | evictable) & in_use)
            if dup or lost or both:
                fail("conservation",
                     f"{where}: expected free + evictable + in-use to be the pool exactly "
                     f"once, observed double-freed {dup}, lost {lost}, free-and-in-use {both}")
        if "no-leak" in CHECKS and not self.live:
            in_use = sorted(b for b, rc in view["refcounts"].items() if rc > 0)
            if in_use:
                fail("no-leak",
                     f"{where}: no sequence is live: expected every block free, observed "
                     f"blocks {in_use} still in use")
        if "window-bound" in CHECKS and self.window is not None:
            W, B = self.window, self.B
            for sid, blocks in held.items():
                start, end = self.model[sid]["step"]
                k = max(1, end - start)
                bound = min((W + k - 2 + B - 1) // B + 1, -(-end // B))
                if len(blocks) > bound:
                    fail("window-bound",
                         f"{where}: seq {sid} (step over positions {start}..{end - 1}, "
                         f"window {W}, block size {B}): expected at most {bound} blocks, "
                         f"observed {len(blocks)} ({blocks})")


def %%TEST%%():
    """%%INVARIANT%%: replay the trace kvspec recorded; fail where the invariant breaks."""
    replay = Replay()
    for i, step in enumerate(TRACE, 1):
        replay.apply(step)
        replay.check(f"after step {i} ({step['op']})")
    replay.free_all()
    replay.check("after freeing every sequence")
'''
