"""Conformance of the BMC transition system (proofs/bmc.py) with the real reference manager.

Random operation sequences run on ``ReferenceManager`` (with the driver's worker writes and
bookkeeping); each operation is replayed through the z3 transition with the choices the
reference made (hit blocks, allocated blocks, published blocks), and the successor must be
unique and equal to the reference's observed state.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvspec.proofs import bmc
from kvspec.reference.manager import ReferenceManager
from kvspec.spec.config import Config
from kvspec.spec.errors import Rejected
from kvspec.spec.interface import Admission
from kvspec.spec.prefix_hash import PrefixKey

VARIANTS = [
    bmc.DEFAULT_BOUNDS,
    bmc.Bounds(window=None),
    bmc.Bounds(window=2, max_lookahead=2),
    bmc.Bounds(block_size=3, window=4, max_slots=3),
    bmc.Bounds(window=3, prefix_caching=False),
]


class Harness:
    def __init__(self, b: bmc.Bounds) -> None:
        self.b = b
        self.mgr = ReferenceManager(
            Config(
                block_size=b.block_size,
                num_blocks=b.num_blocks,
                sliding_window=b.window,
                prefix_caching=b.prefix_caching,
                max_lookahead=b.max_lookahead,
            )
        )
        self.model = bmc.initial_values(b)
        self.mem: dict[int, set[int]] = {}  # block -> written offsets (shadow memory)
        self.tokens: dict[int, list[int]] = {}
        self.step: dict[int, tuple[int, int]] = {}
        self.prompts: list[tuple[int, ...]] = []
        self.ops = 0

    # ------------------------------------------------------------ reference side

    def slots(self, s: int) -> list[int]:
        view = self.mgr.observe().tables.get(s)
        raw = list(view.slots) if view is not None else []
        out = [bmc.NONE if x is None else x for x in raw]
        return out + [bmc.NONE] * (self.b.max_slots - len(out))

    def keys(self) -> set[int]:
        return {block for _, block in self.mgr.observe().gpu.cached}

    def write(self, s: int, lo: int, hi: int) -> None:
        B = self.b.block_size
        table = self.slots(s)
        for pos in range(lo, hi):
            self.mem.setdefault(table[pos // B], set()).add(pos % B)

    def observed(self) -> dict:
        b = self.b
        view = self.mgr.observe()
        keys = self.keys()
        seqs = []
        for s in range(b.num_seqs):
            if s in view.tables:
                start, end = self.step[s]
                sl = self.slots(s)
                seqs.append(
                    {
                        "live": True,
                        "n": self.mgr.seqs[s].num_computed,
                        "st": start,
                        "en": end,
                        "tl": len(view.tables[s].slots),
                        "sl": sl,
                    }
                )
            else:
                seqs.append(
                    {
                        "live": False,
                        "n": 0,
                        "st": 0,
                        "en": 0,
                        "tl": 0,
                        "sl": [bmc.NONE] * b.max_slots,
                    }
                )
        return {
            "rc": [view.gpu.refcounts[x] for x in range(b.num_blocks)],
            "fl": [list(view.gpu.free).count(x) for x in range(b.num_blocks)],
            "ev": [x in view.gpu.evictable for x in range(b.num_blocks)],
            "key": [x in keys for x in range(b.num_blocks)],
            "seqs": seqs,
        }

    # ------------------------------------------------------------ both sides

    def apply(self, choice: dict) -> None:
        after = bmc.concrete_step(self.b, self.model, choice)
        assert after["unique"], f"the model's successor is not unique for {choice}"
        assert not after["immutability_violation"], f"model flags immutability on {choice}"
        assert not after["admission_violation"], f"model flags admission on {choice}"
        want = self.observed()
        for field in ("rc", "fl", "ev", "key", "seqs"):
            assert after[field] == want[field], (
                f"op {self.ops} {choice}: model {field}={after[field]} reference {want[field]}"
            )
        for x in range(self.b.num_blocks):
            if want["rc"][x] > 0 or want["key"][x]:
                got = {o for o, w in enumerate(after["wr"][x]) if w}
                assert got == self.mem.get(x, set()), (
                    f"op {self.ops}: block {x} memory {got} vs {self.mem.get(x)}"
                )
        self.model = after
        self.ops += 1

    def base_choice(self, op: int, s: int = 0, c: int = 0) -> dict:
        T = self.b.max_slots
        return {
            "op": op,
            "s": s,
            "c": c,
            "h": 0,
            "prompt": 1,
            "k": 1,
            "la": 0,
            "hb": [0] * T,
            "a": [0] * T,
            "reg": [False] * T,
        }

    def admit(self, s: int, prompt: tuple[int, ...], k: int) -> None:
        B, T = self.b.block_size, self.b.max_slots
        cached = {key: block for key, block in self.mgr.observe().gpu.cached}
        hits = []
        for i in range((len(prompt) - 1) // B):
            block = cached.get(PrefixKey(tuple(prompt[: (i + 1) * B]), ()))
            if block is None or not self.b.prefix_caching:
                break
            hits.append(block)
        end = min(len(hits) * B + k, len(prompt))
        reserved = end + self.b.max_lookahead  # the reference reserves the run's lookahead
        if reserved > self.b.positions:
            return  # beyond the model's table bound
        choice = self.base_choice(1, s)
        choice.update(h=len(hits), prompt=len(prompt), k=k, hb=hits + [0] * (T - len(hits)))
        if self.mgr.can_admit(s, prompt, k) is Admission.OK:
            hit = self.mgr.admit(s, prompt, k)
            assert hit == len(hits) * B
            table = self.slots(s)
            for i in range(len(hits), (reserved - 1) // B + 1):
                choice["a"][i] = table[i]
                self.mem[table[i]] = set()
            self.write(s, hit, end)
            self.mgr.commit(s, end - hit)
            keys = self.keys()
            choice["reg"] = [table[i] in keys for i in range(T)]
            self.tokens[s] = list(prompt)
            self.step[s] = (hit, reserved)
            if end == len(prompt):
                self.next_token(s)
        self.apply(choice)

    def next_token(self, s: int) -> None:
        token = len(self.tokens[s]) % 3
        self.tokens[s].append(token)
        self.mgr.append_token(s, token)

    def step_seq(self, s: int, k: int, la: int) -> None:
        T = self.b.max_slots
        before = self.slots(s)
        n = self.mgr.seqs[s].num_computed
        choice = self.base_choice(2, s)
        choice.update(k=k, la=la)
        try:
            copies = self.mgr.reserve(s, k, la)
        except Rejected:
            self.apply(choice)
            return
        after = self.slots(s)
        for i in range(T):
            if after[i] != bmc.NONE and after[i] != before[i]:
                choice["a"][i] = after[i]
                self.mem[after[i]] = set()
        for src, dst in copies:
            self.mem[dst] = set(self.mem.get(src, set()))
        self.write(s, n, n + k)
        self.mgr.commit(s, k)
        keys = self.keys()
        choice["reg"] = [after[i] in keys for i in range(T)]
        self.step[s] = (n, max(n + k + la, self.step[s][1]))
        if n + k == len(self.tokens[s]):
            self.next_token(s)
        self.apply(choice)

    def fork(self, p: int, c: int) -> None:
        self.mgr.fork(p, c)
        self.tokens[c] = list(self.tokens[p])
        self.step[c] = self.step[p]
        self.apply(self.base_choice(3, p, c))

    def free(self, s: int) -> None:
        self.mgr.free(s)
        del self.tokens[s], self.step[s]
        self.apply(self.base_choice(4, s))

    def reset(self) -> None:
        self.mgr.reset_prefix_cache()
        self.apply(self.base_choice(5))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bmc_model_matches_reference(data) -> None:
    b = data.draw(st.sampled_from(VARIANTS), label="bounds")
    h = Harness(b)
    P = b.positions
    for _ in range(data.draw(st.integers(1, 12), label="ops")):
        live = sorted(h.tokens)
        idle = [s for s in range(b.num_seqs) if s not in h.tokens]
        kinds = ["reset"]
        if idle:
            kinds.append("admit")
        if live:
            kinds += ["step", "step", "free"]
        if live and idle:
            kinds.append("fork")
        kind = data.draw(st.sampled_from(kinds), label="op")
        if kind == "admit":
            s = data.draw(st.sampled_from(idle))
            base = (
                data.draw(st.sampled_from(h.prompts))
                if h.prompts and data.draw(st.booleans())
                else ()
            )
            base = base[: data.draw(st.integers(0, len(base)))]
            tail = data.draw(st.lists(st.integers(0, 2), max_size=P))
            prompt = (tuple(base) + tuple(tail))[:P] or (0,)
            h.prompts.append(prompt)
            h.admit(s, prompt, data.draw(st.integers(1, P)))
        elif kind == "step":
            s = data.draw(st.sampled_from(live))
            n = h.mgr.seqs[s].num_computed
            remaining = len(h.tokens[s]) - n
            k = data.draw(st.integers(1, max(1, remaining)))
            la = data.draw(st.integers(0, b.max_lookahead))
            if n + k + la <= P and remaining >= 1:
                h.step_seq(s, k, la)
        elif kind == "fork":
            h.fork(data.draw(st.sampled_from(live)), data.draw(st.sampled_from(idle)))
        elif kind == "free":
            h.free(data.draw(st.sampled_from(live)))
        else:
            h.reset()


def test_tables_come_from_the_spec_functions() -> None:
    from kvspec.spec import admission, window

    b = bmc.DEFAULT_BOUNDS
    t = bmc.Tables.of(b)
    for v in range(b.positions + 1):
        assert t.first[v] == window.first_needed_block(v, b.window, b.block_size)
        for e in range(v + 1, b.positions + 1):
            assert t.new[v][e] == admission.new_blocks_for_step(v, e, b.window, b.block_size)
