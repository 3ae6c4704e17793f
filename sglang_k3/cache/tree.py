"""The KDA-aware radix tree: pure Python over ints (token ids, KV pool indices, checkpoint handles).

Why pure Python and not a subclass of upstream's ``UnifiedRadixCache`` components: the same code
must run inside SGLang (wrapped by the integration layer as a ``BasePrefixCache``) *and* inside a
trace-replay simulator in simulated time, with no torch. Upstream's MAMBA component keeps one state
per leaf and hits only on its checkpoint grid; here a node holds any number of checkpoints at
hit-unit multiples inside its span, which is the fine-grained hit the K3 report describes.

Design
------
* **Nodes** are radix edges over token ids, holding one MLA KV index per token. Inserted keys are
  cut to a multiple of ``page_size`` and nodes are only ever split at page multiples, so every
  node's KV is whole pages: eviction frees whole pages and a key that ends inside a page never
  creates an empty or a partial-page node (a key shorter than one page inserts nothing). The one
  exception is a **ragged** insert (a finished request, which writes no more KV): its last,
  partial page becomes (part of) a leaf of its own that never gets children, so the state at the
  request's exact end has a key. Another request that goes on through that page does so in a
  page of its own (it copied the ragged slots: ``kv_cow_tokens``), and the ragged leaf's
  checkpoints then move to the node holding that page (:meth:`K3RadixTree._absorb_ragged`).
* **Matching is token-granular**: phase 1 follows exact full pages through the children dict and,
  where the request diverges inside a page, scans siblings for the longest token match, so
  ``mla_len`` can end inside a page. Phase 2 picks the largest checkpoint position
  ``<= min(mla_len, len(key) - 1)`` on the path that is ready and has a handle in *every* KDA
  group. The cap ``len(key) - 1`` makes a fully cached prompt still hit (one token is left to
  compute, everything up to the nearest checkpoint before it is reused).
* **Checkpoints** live on the node whose span ``(start, end]`` contains their position, not only at
  node ends, so a hit may land inside a physical page (2800 matched, checkpoint at 2560 ->
  restore 2560). The caller copies the ``restore_len % page_size`` KV slots of the shared last page
  into a private page (``MatchResult.kv_cow_tokens``) before extending. Limitation: with
  ``page_size > 1`` a branch-point checkpoint placed inside a page that two siblings share
  token-wise lands on the inserting request's sibling only.
* **Ownership**: the tree never writes a checkpoint. It registers handles (``add_checkpoint``,
  by copy or by donation), holds them read-only, and hands them back in :class:`Freed`. The three
  K3 invariants are enforced here: (1) ``match_prefix(pin=True)`` pins the checkpoint (all groups
  at once) and locks the KV path under it before returning, so nothing the caller allocates next
  can evict it; (2) a checkpoint is not matchable (and not evictable) until ``mark_ready`` /
  ``commit_step`` says its copy landed; (3) a boundary's groups go together: dropping or evicting
  a checkpoint hands back every group's handle at once (a half boundary would linger
  unrestorable).

The class is three parts, one file each: this file is the radix structure (walk, match, insert,
split, ragged pages, locks, the removal of KV); :mod:`~sglang_k3.cache.registry` is the registry of
checkpoints and their flags (the only code that changes them); :mod:`~sglang_k3.cache.retention`
is every rule of what is kept and what goes (pricing, the waiting queue's wants, ranking,
eviction, dead-KV trims, recycling, dropping superseded states).
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence

from sglang_k3.cache.actions import DropReason, Freed
from sglang_k3.cache.ghosts import EvictedKV, MissCounts, ReuseLearner
from sglang_k3.cache.invariants import check_tree
from sglang_k3.cache.node import Checkpoint, Node, differing, lcp, page_child
from sglang_k3.cache.ranking import EvictionPolicy
from sglang_k3.cache.registry import CheckpointRegistry
from sglang_k3.cache.results import InsertResult, MatchResult
from sglang_k3.cache.retention import Retention
from sglang_k3.cache.stats import CacheStats, MatchRecord


class K3RadixTree(Retention, CheckpointRegistry):
    def __init__(
        self,
        num_groups: int,
        page_size: int = 1,
        hit_unit: int = 64,
        eviction: Optional[EvictionPolicy] = None,
        lock_protects_checkpoints: bool = True,
        has_slack: Optional[Callable[[], bool]] = None,
    ) -> None:
        if num_groups < 1 or page_size < 1 or hit_unit < 1:
            raise ValueError("num_groups, page_size and hit_unit must be >= 1")
        self.num_groups = num_groups
        self.page_size = page_size
        self.hit_unit = hit_unit
        self.policy = eviction or EvictionPolicy()
        # True: a checkpoint on a locked path is never evicted. False: only pins protect it
        # (a caller whose requests keep private state copies needs a checkpoint only until its
        # copy has landed, and pins exactly that window).
        self.lock_protects_checkpoints = lock_protects_checkpoints
        # True when a lower tier keeps evicted boundaries: an eviction then hands back a
        # SaveBoundary (the path's tokens and KV indices) before the checkpoint's release.
        self.capture_evicted = False
        self.stats = CacheStats()
        self.misses = MissCounts()
        # With a learner, retention keeps states its placement rules would drop when their class
        # has been reused (sglang_k3.cache.ghosts); None: the rules alone (the baselines' trees).
        self.reuse: Optional[ReuseLearner] = None
        # Whether the budget has memory nobody holds (the unified ledger's free blocks): then a
        # state a placement rule lets go stays until memory is short (Retention.let_go). None:
        # such states go at once (fixed pools, the baselines' trees).
        self.has_slack = has_slack
        self._clock = 0
        self._next_id = 0
        self._reset_state()

    # ------------------------------------------------------------------ bookkeeping
    def _reset_state(self) -> None:
        self.root = Node(id=self._new_id(), parent=None, start=0)
        self.evicted = EvictedKV(self.page_size)  # ghosts of evicted KV (miss attribution)
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self._reset_registry()
        self._reset_wants()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _check_attached(self, node: Node) -> None:
        if node is not self.root and node.parent is None:
            raise ValueError(f"{node!r} is no longer in the tree (evicted)")

    def _path(self, node: Node) -> Iterator[Node]:
        """Nodes from ``node`` up to (excluding) the root."""
        while node is not self.root:
            yield node
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ sizes
    def evictable_size(self) -> int:
        """KV slots in unlocked nodes (tokens; a ragged leaf's partial page counts whole)."""
        return self._evictable_tokens

    def protected_size(self) -> int:
        """KV slots in locked nodes (tokens; a ragged leaf's partial page counts whole)."""
        return self._protected_tokens

    def total_size(self) -> int:
        return self._evictable_tokens + self._protected_tokens

    # ------------------------------------------------------------------ matching
    def _find_child(self, node: Node, key: Sequence[int], pos: int) -> tuple[Optional[Node], int]:
        return page_child(node.children, key, pos, self.page_size)  # type: ignore[return-value]

    def _walk(self, key: Sequence[int]) -> tuple[list[Node], int]:
        """Phase 1: nodes touched by the longest token match and its length."""
        node, pos, path = self.root, 0, []
        while pos < len(key):
            child, n = self._find_child(node, key, pos)
            if child is None or n == 0:
                break
            path.append(child)
            pos += n
            if n < len(child.key):
                break
            node = child
        return path, pos

    def _best_checkpoint(self, path: list[Node], cap: int) -> Optional[Checkpoint]:
        best: Optional[Checkpoint] = None
        for node in reversed(path):
            for ck in node.checkpoints.values():
                if ck.pos <= cap and ck.matchable and (best is None or ck.pos > best.pos):
                    best = ck
            if best is not None:
                break  # checkpoints on deeper nodes always sit at larger positions
        return best

    def _lookup(self, key: Sequence[int]) -> tuple[list[Node], int, int, Optional[Checkpoint], int]:
        """Both phases, and the path and the checkpoint found become the most recently used:
        ``(path, mla_len, cap, best, now)``."""
        path, mla_len = self._walk(key)
        cap = min(mla_len, len(key) - 1)
        best = self._best_checkpoint(path, cap)
        now = self._tick()
        for node in path:
            node.last_access = now
        if best is not None:
            best.last_access = now
        return path, mla_len, cap, best, now

    def match_prefix(self, key: Sequence[int], pin: bool = True) -> MatchResult:
        """Two-phase lookup; with ``pin`` the hit is pinned before returning (invariant 1)."""
        path, mla_len, cap, best, now = self._lookup(key)
        restore = best.pos if best is not None else 0
        kv: list[int] = []
        for node in path:
            if node.start >= restore:
                break
            kv.extend(node.kv[: restore - node.start])
        res = MatchResult(
            mla_len=mla_len,
            restore_len=restore,
            kv_indices=kv,
            handles=[h for h in best.handles] if best is not None else [],  # type: ignore[misc]
            node=best.node if best is not None else self.root,  # type: ignore[arg-type]
            checkpoint=best,
            kv_cow_tokens=restore % self.page_size,
            replayed_tokens=max(0, cap - restore),
        )
        if best is not None and pin:
            res.pin = self.pin_hit(best)
        self._ghost_hit(path, key, mla_len, cap, restore, learn=pin)
        self.stats.record_match(MatchRecord(len(key), mla_len, restore, res.replayed_tokens))
        return res

    def _ghost_hit(self, path: list[Node], key: Sequence, mla_len: int, cap: int, restore: int, learn: bool) -> None:
        """A match restored ``restore`` of ``key``'s tokens: count the rest by cause
        (``self.misses``, as ``stats`` counts every lookup; the evicted KV past ``mla_len`` from the
        ghosts of evicted KV), and, when it is admitted (``learn``), a ghost it would have
        restored from (the deepest one in ``(restore, cap]``) as a use of its class
        (:mod:`sglang_k3.cache.ghosts`)."""
        gpos, ghost = 0, None
        for node in reversed(path):
            if node.end <= restore:
                break
            for pos, g in node.ghosts.items():
                if restore < pos <= cap and pos > gpos:
                    gpos, ghost = pos, g
            if ghost is not None:
                break  # ghosts on deeper nodes sit at larger positions
        end = path[-1] if path else self.root
        evicted = self.evicted.run(end.gone, key, mla_len) if mla_len == end.end else 0
        self.misses.record(len(key), mla_len, cap, restore, gpos, ghost, evicted, self.capture_evicted)
        if learn and ghost is not None and ghost.watch >= 0:
            if self.reuse is not None:
                self.reuse.reused(ghost.watch, self.policy.flops(restore, gpos))
            ghost.watch = -1  # a state counts once

    def find_branch_point(self, key: Sequence[int]) -> Optional[int]:
        """Marconi-style speculative insertion, read-only: where would ``key`` fork off an
        existing path? Returns that position rounded down to the hit unit, or None when the key
        only extends a leaf, is fully contained, or shares less than one hit unit."""
        path, mla_len = self._walk(key)
        if not path or mla_len >= len(key):
            return None
        last = path[-1]
        if mla_len == last.end and last.is_leaf:
            return None  # plain extension of a cached path (e.g. the next turn)
        bp = mla_len // self.hit_unit * self.hit_unit
        return bp or None

    def path_kv(self, node: Node) -> list[int]:
        """KV indices from the root to ``node``'s end."""
        self._check_attached(node)
        out: list[int] = []
        for n in reversed(list(self._path(node))):
            out.extend(n.kv)
        return out

    def path_prefix(self, node: Node, pos: int) -> tuple[list[int], list[int]]:
        """Tokens and KV indices of the path to ``node``, cut at ``pos`` (``<= node.end``)."""
        self._check_attached(node)
        tokens: list[int] = []
        kv: list[int] = []
        for n in reversed(list(self._path(node))):
            tokens.extend(n.key)
            kv.extend(n.kv)
        return tokens[:pos], kv[:pos]

    def peek(self, key: Sequence[int]) -> tuple[list[Node], int, int]:
        """Read-only lookup, no recency, pins or stats: ``(path, mla_len, restore_len)``, the
        path being the nodes the KV match touched (the last one possibly only in part)."""
        path, mla_len = self._walk(key)
        best = self._best_checkpoint(path, min(mla_len, len(key) - 1))
        return path, mla_len, best.pos if best is not None else 0

    @staticmethod
    def prefix_kv(path: Sequence[Node], n: int) -> list[int]:
        """KV indices of the first ``n`` tokens along ``path`` (as :meth:`peek` returns it)."""
        out: list[int] = []
        for node in path:
            if len(out) >= n:
                break
            out.extend(node.kv[: n - len(out)])
        return out

    # ------------------------------------------------------------------ insertion
    def _slots(self, node: Node) -> int:
        """KV slots ``node`` keeps from the pool: its tokens, and a ragged leaf's whole last page
        (what the evictable and protected sizes count, as SGLang's pool accounting does)."""
        return -(-len(node.key) // self.page_size) * self.page_size

    def _ragged(self, node: Node) -> bool:
        """A leaf whose last KV page is partial: a request that ended inside a page left it."""
        return len(node.key) % self.page_size != 0

    def _split(self, child: Node, n: int) -> Node:
        """Split ``child`` after ``n`` tokens (a page multiple); returns the new upper node."""
        p = self.page_size
        assert 0 < n < len(child.key) and n % p == 0
        parent = child.parent
        assert parent is not None
        mid = Node(id=self._new_id(), parent=parent, start=child.start, key=child.key[:n], kv=child.kv[:n])
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        for pos in [q for q in child.checkpoints if q <= mid.end]:
            ck = child.checkpoints.pop(pos)
            ck.node = mid
            mid.checkpoints[pos] = ck
        for pos in [q for q in child.ghosts if q <= mid.end]:
            mid.ghosts[pos] = child.ghosts.pop(pos)
        parent.children[tuple(child.key[:p])] = mid
        child.key, child.kv, child.start, child.parent = child.key[n:], child.kv[n:], mid.end, mid
        mid.children[tuple(child.key[:p])] = child
        if self._ragged(child):  # the ragged remainder now hangs under mid
            parent.ragged -= 1
            mid.ragged += 1
        return mid

    def insert(self, key: Sequence[int], kv: Sequence[int], ragged: bool = False) -> InsertResult:
        """Insert a request's KV. Only ``len(key)`` rounded down to the page size is taken, unless
        ``ragged``: then the last, partial page is taken too, as a leaf of its own (a finished
        request's last page: nothing writes into it any more, so the tree may own it). Requests
        that restore inside it copy its slots to a page of their own
        (``MatchResult.kv_cow_tokens``); a ragged leaf never gets children."""
        if len(key) != len(kv):
            raise ValueError("key and kv must have the same length")
        p = self.page_size
        limit = len(key) if ragged else len(key) // p * p
        node, pos, dup = self.root, 0, []
        now = self._tick()
        prefix_len = limit
        while pos < limit:
            rest = limit - pos
            if rest < p:  # a ragged end: a child that already holds these tokens covers it
                child = self._covering_child(node, key, pos, rest)
                if child is not None:
                    dup.extend(differing(kv, pos, child.kv, rest))
                    child.last_access = now
                    node, pos = child, limit
                    break
            else:
                child = node.children.get(tuple(key[pos : pos + p]))
            if child is None:
                prefix_len = pos
                leaf = Node(
                    id=self._new_id(),
                    parent=node,
                    start=pos,
                    key=list(key[pos:limit]),
                    kv=list(kv[pos:limit]),
                    last_access=now,
                )
                node.children[tuple(leaf.key[:p])] = leaf
                node.gone.pop(tuple(leaf.key[:p]), None)  # the KV evicted there is back
                self._evictable_tokens += self._slots(leaf)
                if self._ragged(leaf):
                    node.ragged += 1
                dup.extend(self._absorb_ragged(node, leaf))
                node, pos = leaf, limit
                break
            n = min(lcp(child.key, key, pos), limit - pos) // p * p
            if n < len(child.key):
                child = self._split(child, n)
            dup.extend(differing(kv, pos, child.kv, n))
            child.last_access = now
            dup.extend(self._absorb_ragged(node, child))
            node, pos = child, pos + n
        return InsertResult(prefix_len=prefix_len, inserted_len=limit, duplicate_kv=dup, node=node)

    def _covering_child(self, node: Node, key: Sequence[int], pos: int, n: int) -> Optional[Node]:
        """A child of ``node`` whose key starts with ``key[pos:pos + n]`` (``n`` under a page)."""
        want = list(key[pos : pos + n])
        for child in node.children.values():
            if child.key[:n] == want:
                return child
        return None

    def _absorb_ragged(self, parent: Node, into: Node) -> list[int]:
        """Ragged leaves under ``parent`` whose tokens ``into`` also holds (a later request went on
        through the same page, in a page of its own) hand their checkpoints to ``into`` and leave:
        otherwise a lookup that follows ``into`` would never see those states. Same tokens, same
        KV, so the checkpoints stay valid over ``into``'s slots. A ragged leaf that is locked, or
        whose checkpoints are pinned, not landed, or already present in ``into``, stays (a later
        insert through ``into`` tries again). Returns the KV indices the leaves held, to free."""
        if parent.ragged == 0:
            return []
        freed: list[int] = []
        for leaf in list(parent.children.values()):
            if (
                leaf is into
                or not self._ragged(leaf)
                or leaf.lock_ref
                or len(leaf.key) >= len(into.key)
                or into.key[: len(leaf.key)] != leaf.key
                or any(ck.pins or not ck.ready or ck.pos in into.checkpoints for ck in leaf.checkpoints.values())
            ):
                continue
            for pos, ck in leaf.checkpoints.items():
                ck.node = into
                into.checkpoints[pos] = ck
                self._restat(ck)
            leaf.checkpoints = {}
            del parent.children[tuple(leaf.key[: self.page_size])]
            parent.ragged -= 1
            leaf.parent = None
            self._evictable_tokens -= self._slots(leaf)
            freed.extend(leaf.kv)
        return freed

    def inc_lock_ref(self, node: Node) -> int:
        """Lock ``node`` and its ancestors; returns the KV tokens moved to protected."""
        self._check_attached(node)
        delta = 0
        for n in self._path(node):
            n.lock_ref += 1
            if n.lock_ref == 1:
                delta += self._slots(n)
                for ck in n.checkpoints.values():
                    self._restat(ck)
        self._evictable_tokens -= delta
        self._protected_tokens += delta
        return delta

    def dec_lock_ref(self, node: Node) -> int:
        """Unlock; returns the KV tokens moved back to evictable. Raises rather than go negative."""
        self._check_attached(node)
        path = list(self._path(node))
        if any(n.lock_ref <= 0 for n in path):
            raise AssertionError(f"lock_ref would go negative on the path to {node!r}")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                delta += self._slots(n)
                for ck in n.checkpoints.values():
                    self._restat(ck)
        self._evictable_tokens += delta
        self._protected_tokens -= delta
        return delta

    # ------------------------------------------------------------------ removal
    def _leaves(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def _trim_leaf(self, leaf: Node, keep_end: int) -> Freed:
        """Free the leaf's KV past ``keep_end`` (a page multiple); removes the leaf at its start."""
        assert leaf.lock_ref == 0 and leaf.is_leaf and keep_end % self.page_size == 0
        cut = keep_end - leaf.start
        out = leaf.kv[cut:]
        self._evictable_tokens -= self._slots(leaf) - cut
        parent = leaf.parent
        assert parent is not None
        if self._ragged(leaf):
            parent.ragged -= 1  # removed, or cut back to whole pages
        held = self.total_size() + len(out)
        if cut == 0:
            assert not leaf.checkpoints
            del parent.children[tuple(leaf.key[: self.page_size])]
            self.evicted.add(parent.gone, leaf.key, leaf.gone, held)
            leaf.parent = None
        else:
            gone, leaf.gone = leaf.gone, {}
            self.evicted.add(leaf.gone, leaf.key[cut:], gone, held)
            leaf.key, leaf.kv = leaf.key[:cut], leaf.kv[:cut]
            for pos in [q for q in leaf.ghosts if q > keep_end]:
                del leaf.ghosts[pos]  # a ghost lives as long as the KV it sat on
        freed = Freed()
        freed.add_kv(out)
        return freed

    def reset(self) -> Freed:
        """Drop everything and return every KV index and handle the tree held. The caller must
        have no outstanding locks or pins (their nodes are detached afterwards)."""
        freed = Freed()
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            freed.add_kv(n.kv)
            for ck in n.checkpoints.values():
                freed.add_checkpoint(ck.held_handles(), ck.pos, ck.nbytes, DropReason.RESET)
                ck.node = None
            n.parent = None
        self._reset_state()
        return freed

    # ------------------------------------------------------------------ self-check
    def check_invariants(self) -> None:
        """Recompute everything from scratch and assert the incremental state agrees (tests):
        :func:`~sglang_k3.cache.invariants.check_tree`."""
        check_tree(self)
