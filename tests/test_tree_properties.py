"""Hypothesis: random op sequences against integer pools. After every op the pools agree with
what the tree holds (no leaks, no double frees), refcounts stay >= 0, no handle is written while
the tree holds it, and a pinned checkpoint is unchanged when its COW lands. After flush the
pools are empty."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from int_pools import IntPool, PagedPool

from sglang_k3.cache import CheckpointBusy, CheckpointKind, K3RadixTree, PlacementPolicy

UNIT = 16
BASES = [[b * 1000 + i for i in range(300)] for b in range(3)]

op = st.tuples(
    st.sampled_from(
        [
            "insert",
            "insert",
            "extend",
            "match",
            "match",
            "match",
            "unlock",
            "ckpt",
            "ckpt",
            "ckpt",
            "commit",
            "land",
            "evict_kv",
            "evict_b",
            "recycle",
            "drop",
            "write",
        ]
    ),
    st.integers(0, 2),
    st.integers(0, 300),
    st.integers(0, 40),
    st.integers(0, 10_000),
)


class Harness:
    def __init__(self, page: int, groups: int, protects: bool = True, unit: int = UNIT) -> None:
        # protects=False: the lifecycle's tree, where only pins (not path locks) hold checkpoints.
        # unit=1: the server's tree, where a state may sit at any position (a request's end).
        self.unit = unit
        self.tree = K3RadixTree(num_groups=groups, page_size=page, hit_unit=unit, lock_protects_checkpoints=protects)
        self.kv, self.h = PagedPool(20_000 // page + 8, page), IntPool(2_000)
        self.nodes, self.locks, self.pins = [], [], []

    def key(self, b, n, s):
        return BASES[b][:n] + [7] * s

    def write(self, handle):
        assert handle not in self.tree._handle_owner, f"write to shared checkpoint slot {handle}"
        self.h.write(handle)

    def free(self, freed):
        self.free_kv(freed.kv_indices)
        self.h.free(freed.handles)

    def free_kv(self, idx):
        """Freeing any slot frees its whole page: no page the tree still uses may go."""
        pages = self.kv.free(idx)
        held = {i // self.kv.page_size for i in self.tree_kv()}
        assert not pages & held, f"pages {sorted(pages & held)} freed while the tree holds slots in them"

    def tree_kv(self):
        return [i for _, i in self._positions()]

    def step(self, name, b, n, s, r):
        t, rnd = self.tree, random.Random(r)
        live = [x for x in self.nodes if x is t.root or x.parent is not None]
        if name == "insert":
            key = self.key(b, n, s)
            kv = self.kv.alloc_row(len(key))
            res = t.insert(key, kv, ragged=r % 3 == 0)  # a finished request keeps its last page
            self.free_kv(res.duplicate_kv + kv[res.inserted_len :])
            self.nodes.append(res.node)
            if r % 2 and res.node is not t.root:  # a running request holds its own path
                t.inc_lock_ref(res.node)
                self.locks.append(res.node)
        elif name == "extend" and any(x is not t.root for x in live):
            # the next turn: a cached path (often a ragged end) and more, through its last page
            node = rnd.choice([x for x in live if x is not t.root])
            key = t.path_prefix(node, node.end)[0] + [8] * (s + 1)
            kv = self.kv.alloc_row(len(key))
            res = t.insert(key, kv, ragged=r % 3 == 0)
            self.free_kv(res.duplicate_kv + kv[res.inserted_len :])
            self.nodes.append(res.node)
        elif name == "match":
            m = t.match_prefix(self.key(b, n, s), pin=bool(r % 2))
            assert m.restore_len % self.unit == 0 and m.restore_len <= max(0, n + s - 1)
            assert len(m.kv_indices) == m.restore_len
            assert all(i // self.kv.page_size in self.kv.allocated for i in m.kv_indices)
            assert m.kv_cow_tokens == m.restore_len % t.page_size
            if m.checkpoint is not None:
                assert m.checkpoint.matchable
            if m.pin is not None:
                self.pins.append((m.pin, {x: self.h.version[x] for x in m.handles}))
            if m.node is not t.root and m.pin is not None:
                t.inc_lock_ref(m.node)
                self.locks.append(m.node)
            self.nodes.append(m.node)
        elif name == "unlock" and self.locks:
            t.dec_lock_ref(self.locks.pop(r % len(self.locks)))
        elif name == "land" and self.pins:
            pin, versions = self.pins.pop(r % len(self.pins))
            assert all(self.h.version[x] == v for x, v in versions.items()), "pinned checkpoint was overwritten"
            t.release_pin(pin)
        elif name == "ckpt" and live:
            node = rnd.choice(live)
            if node.end >= self.unit:
                # a node's end (a ragged one: a request's exact end) or any unit multiple on its path
                at_end = node.end % self.unit == 0 and r % 3 == 0
                pos = node.end if at_end else rnd.randint(1, node.end // self.unit) * self.unit
                hs = self.h.alloc(t.num_groups)
                for x in hs:
                    self.write(x)  # the copy/donation lands in a fresh slot
                kind = rnd.choice(list(CheckpointKind))
                if t.add_checkpoint(node, pos, hs, nbytes=100, kind=kind, ready=bool(r % 2 == 0)) is None:
                    self.h.free(hs)
        elif name == "commit":
            t.commit_step()
        elif name == "evict_kv":
            # what the cache may promise SGLang's admission (evictable less stuck) is freeable;
            # tokens and slots are the same only at page 1 (a ragged leaf's page counts whole)
            promised = t.evictable_size() - t.stuck_kv_tokens()
            freed = t.evict(num_tokens=n)
            assert self.kv.page_size > 1 or len(freed.kv_indices) >= min(n, promised)
            self.free(freed)
        elif name == "evict_b":
            self.free(t.evict(num_bytes=n * 10))
        elif name == "recycle" and self.locks:
            self.free(t.recycle_path(rnd.choice(self.locks), PlacementPolicy(per_path_budget=2)))
        elif name == "drop" and t.checkpoints():
            ck = rnd.choice(t.checkpoints())
            try:
                self.free(t.drop_checkpoint(ck))
            except CheckpointBusy:
                assert ck.pins > 0 or not ck.ready
        elif name == "write" and self.h.allocated:
            # active slots owned by requests are written every step; never a tree-held one
            owned = sorted(self.h.allocated - set(t._handle_owner))
            if owned:
                self.write(rnd.choice(owned))
        self.check()

    def check(self):
        t = self.tree
        t.check_invariants()
        p = self.kv.page_size
        held = self.tree_kv()
        assert len(held) == len(set(held)), "KV index held twice"
        assert {i // p for i in held} == self.kv.allocated, "KV page leaked or freed while held"
        assert t.total_size() == len(self.kv.allocated) * p, "the tree's size is not the pages it holds"
        for q, i in self._positions():  # a row's position q sits at offset q % page of its page
            assert i % p == q % p
        assert self.h.used == len(t._handle_owner), "checkpoint handle leak"
        assert t.evictable_size() >= 0 and t.protected_size() >= 0

    def _positions(self):
        stack = list(self.tree.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield from zip(range(n.start, n.end), n.kv)

    def flush(self):
        t = self.tree
        for pin, versions in self.pins:
            assert all(self.h.version[x] == v for x, v in versions.items())
            t.release_pin(pin)
        for node in self.locks:
            t.dec_lock_ref(node)
        t.commit_step()
        self.free(t.evict(num_tokens=10**9, num_bytes=10**12))
        self.check()
        assert t.total_size() == 0 and t.checkpoint_count() == 0 and not t.root.children
        assert not self.kv.allocated and self.h.used == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([1, 4, 16, 32]),
    groups=st.integers(1, 3),
    protects=st.booleans(),
    ops=st.lists(op, max_size=60),
)
def test_random_ops_then_flush_leaks_nothing(page, groups, protects, ops):
    """check_invariants also recounts which checkpoints are evictable against the tree's running
    tally (``evictable_checkpoint_bytes``), after every op."""
    hz = Harness(page, groups, protects)
    for o in ops:
        hz.step(*o)
    hz.flush()


@settings(max_examples=100, deadline=None)
@given(page=st.sampled_from([1, 16]), ops=st.lists(op, max_size=40))
def test_reset_returns_everything(page, ops):
    hz = Harness(page, 2)
    for o in ops:
        hz.step(*o)
    freed = hz.tree.reset()
    hz.free(freed)
    assert not hz.kv.allocated and hz.h.used == 0 and hz.tree.total_size() == 0
    assert hz.tree.checkpoint_count() == 0 and hz.tree.checkpoint_bytes() == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page=st.sampled_from([4, 16]), protects=st.booleans(), ops=st.lists(op, max_size=60))
def test_ragged_request_ends_with_exact_states_leak_nothing(page, protects, ops):
    """The server's tree: states at any position, including ragged leaves' exact ends, restores
    inside a page (``kv_cow_tokens``), and ragged leaves absorbed by the pages that go on through
    them; freeing is by whole pages and never hits a page the tree still uses."""
    hz = Harness(page, 1, protects, unit=1)
    for o in ops:
        hz.step(*o)
    hz.flush()
