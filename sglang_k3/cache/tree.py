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
* **Eviction** of two resources: KV tokens (leaves only, never locked ones; KV past a leaf's last
  checkpoint is dead for restores and goes first; a leaf whose KV goes loses its checkpoints) and
  checkpoint bytes (dropping a checkpoint keeps its KV: the node becomes a pass-through). Order
  is utility = recency + FLOPs saved per byte (:mod:`eviction`), LRU tie-break.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Sequence

from sglang_k3.cache.eviction import Candidate, EvictionPolicy, rank
from sglang_k3.cache.node import Checkpoint, CheckpointKind, Node
from sglang_k3.cache.results import DropReason, Freed, InsertResult, MatchResult, Pin
from sglang_k3.cache.stats import CacheStats, MatchRecord


class CheckpointBusy(RuntimeError):
    """Raised when asked to drop a checkpoint that is pinned or whose copy has not landed."""


def _lcp(a: Sequence[int], key: Sequence[int], pos: int) -> int:
    n = min(len(a), len(key) - pos)
    i = 0
    while i < n and a[i] == key[pos + i]:
        i += 1
    return i


class K3RadixTree:
    def __init__(
        self,
        num_groups: int,
        page_size: int = 1,
        hit_unit: int = 64,
        eviction: Optional[EvictionPolicy] = None,
        lock_protects_checkpoints: bool = True,
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
        # True when a lower tier keeps evicted boundaries: an eviction then hands back the path's
        # tokens and KV indices with the checkpoint (ReleaseCheckpoint.path_tokens / path_kv).
        self.capture_evicted = False
        self.stats = CacheStats()
        self._clock = 0
        self._next_id = 0
        self._reset_state()

    # ------------------------------------------------------------------ bookkeeping
    def _reset_state(self) -> None:
        self.root = Node(id=self._new_id(), parent=None, start=0)
        self._ckpts: dict[int, Checkpoint] = {}
        self._handle_owner: dict[int, Checkpoint] = {}
        self._pending: set[int] = set()
        self._stuck: set[int] = set()  # ids of checkpoints that cannot be evicted now
        self._stuck_bytes = 0
        self._stuck_free: set[int] = set()  # of _stuck, those on an unlocked node (stuck_kv_tokens)
        # The waiting queue's last refresh: a run of touch() calls with nothing else between them
        # (SGLang touches the whole queue in one loop). It started at clock _wanted_since; a
        # checkpoint touched in it is wanted by a waiting request (Checkpoint.wanted).
        self._wanted_since = 1 << 62
        self._last_touch = -1
        self._evictable_tokens = 0
        self._protected_tokens = 0
        self.stats.checkpoints = 0
        self.stats.checkpoint_bytes = 0

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

    def stuck_kv_tokens(self) -> int:
        """Of :meth:`evictable_size`, the KV slots no eviction can free now: the unlocked path up
        to each checkpoint that cannot go yet (its copy has not landed, or it is pinned). Eviction
        takes a leaf's KV only with its checkpoints, so this KV stays until they can go; a caller
        that admits work against the evictable size must not count it (SGLang's prefill admission
        did, then failed its allocation with "Out of memory" and stopped the server).

        Summed once per node holding a stuck checkpoint, over unlocked nodes only
        (``_stuck_free``, kept by :meth:`_restat`): those on a running request's locked path, most
        of the stuck ones, hold KV that is protected already. SGLang asks for the evictable size
        several times a step. With 128 running requests and 16 unlanded copies (three checkpoints
        each) a call costs 19 us; iterating every stuck checkpoint cost 78 us."""
        counted: dict[int, int] = {}
        for holder in {self._ckpts[cid].node for cid in self._stuck_free}:
            for n in self._path(holder):  # type: ignore[arg-type]
                if n.lock_ref:
                    break  # ancestors of a locked node are locked too
                slots = self._slots(n)
                if n is holder and n.is_leaf:  # a leaf's KV past its last checkpoint can be trimmed
                    slots = min(slots, self._keep_end(n) - n.start)
                counted[n.id] = max(counted.get(n.id, 0), slots)
        return sum(counted.values())

    def protected_size(self) -> int:
        """KV slots in locked nodes (tokens; a ragged leaf's partial page counts whole)."""
        return self._protected_tokens

    def total_size(self) -> int:
        return self._evictable_tokens + self._protected_tokens

    def checkpoint_count(self) -> int:
        return len(self._ckpts)

    def checkpoint_bytes(self) -> int:
        return self.stats.checkpoint_bytes

    def evictable_checkpoint_bytes(self) -> int:
        """Bytes of the checkpoints :meth:`checkpoint_evictable` would let go now. Kept up to
        date at every pin, lock, landing and drop (:meth:`_restat`), not summed per call: the
        unified budget asks it each time SGLang asks the KV allocator its size, several times a
        scheduler step, over up to thousands of checkpoints."""
        return self.stats.checkpoint_bytes - self._stuck_bytes

    def _restat(self, ck: Checkpoint) -> None:
        """Re-file ``ck`` as evictable or stuck after one of its conditions changed."""
        stuck = ck.node is not None and not self.checkpoint_evictable(ck)
        if stuck and ck.id not in self._stuck:
            self._stuck.add(ck.id)
            self._stuck_bytes += ck.nbytes
        elif not stuck and ck.id in self._stuck:
            self._stuck.remove(ck.id)
            self._stuck_bytes -= ck.nbytes
        if stuck and not ck.node.lock_ref:  # type: ignore[union-attr]
            self._stuck_free.add(ck.id)
        else:
            self._stuck_free.discard(ck.id)

    def checkpoints(self) -> list[Checkpoint]:
        return list(self._ckpts.values())

    # ------------------------------------------------------------------ matching
    def _find_child(self, node: Node, key: Sequence[int], pos: int) -> tuple[Optional[Node], int]:
        p = self.page_size
        if pos + p <= len(key):
            child = node.children.get(tuple(key[pos : pos + p]))
            if child is not None:
                return child, _lcp(child.key, key, pos)
            if p == 1:
                return None, 0  # one-token pages: a missing first token matches no sibling
        best, best_n = None, 0  # divergence or end of key inside the first page: scan siblings
        for child in node.children.values():
            n = _lcp(child.key[:p], key, pos)
            if n > best_n:
                best, best_n = child, n
        return best, best_n

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

    def touch(self, key: Sequence[int]) -> int:
        """Make ``key``'s cached path and the checkpoint a match would restore from the most
        recently used, as a lookup would, without pinning or counting a lookup (a waiting
        request's refresh: it is about to be matched, so what it will hit should not be evicted
        first). Returns the restore length it would get.

        The checkpoint also becomes *wanted*: eviction takes it only after everything no waiting
        request wants (:func:`~sglang_k3.cache.eviction.rank`). Touches with nothing else between
        them are one refresh of the queue, tail first: the first touch of a new run ends the last
        refresh's wants (those requests were admitted, or left), and within a run the later touch
        (nearer the queue's head) is kept longer. An admitted match does not end a want: other
        queued requests may restore from the same checkpoint (a shared system prompt's), and the
        refresh that follows the admission knows. Clearing it there let a batch's first admission
        expose the shared state to the batch's own allocations: with fp32 checkpoints under the
        live A/B's pressure budget, whole batches of four then missed the system prompt (5,120
        cached tokens of 21,760, against 8,276 when the want holds).

        The shared states below the one it would restore from (branch points on its path) become
        wanted too: if that one goes, the request restores there. Otherwise such a state, older
        than every turn end above it, was evicted first, and the queued turns whose own states
        went after it missed their system prompt as well."""
        if self._clock != self._last_touch:
            self._wanted_since = self._clock + 1
            self.stats.waiting_refreshes += 1
        path, _, _, best, _ = self._lookup(key)
        self._last_touch = self._clock
        if best is None:
            return 0
        best.wanted = self._clock
        for node in path:  # the shared states it falls back to if ``best`` goes
            for ck in node.checkpoints.values():
                if ck.pos < best.pos and self.is_branch_point(ck):
                    ck.wanted = self._clock  # a later touch is nearer the queue's head: it wins
        return best.pos

    def end_wants(self) -> None:
        """No request waits (the queue emptied): the last refresh's wants end (a request of it
        that left without a match, e.g. aborted, would otherwise keep its checkpoint wanted)."""
        self._wanted_since = 1 << 62

    def wanted(self, ck: Checkpoint) -> int:
        """The clock of the touch by which a waiting request of the last refresh wants ``ck``,
        0 when none does."""
        return ck.wanted if ck.wanted >= self._wanted_since else 0

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
            best.hits += 1
            best.superseded = False  # a hit: it serves more than a repeat that may never come
            best.pins += 1
            self.inc_lock_ref(best.node)  # type: ignore[arg-type]
            self._restat(best)
            res.pin = Pin(checkpoint=best, node=best.node)  # type: ignore[arg-type]
        self.stats.record_match(MatchRecord(len(key), mla_len, restore, res.replayed_tokens))
        return res

    def release_pin(self, pin: Pin) -> None:
        """The COW out of the pinned checkpoint has landed: it may be evicted again."""
        if pin.released:
            raise ValueError("pin released twice")
        if pin.checkpoint.pins <= 0:
            raise AssertionError("checkpoint pin count would go negative")
        pin.released = True
        pin.checkpoint.pins -= 1
        self.dec_lock_ref(pin.node)
        self._restat(pin.checkpoint)

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
                    dup.extend(kv[pos + i] for i in range(rest) if kv[pos + i] != child.kv[i])
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
                self._evictable_tokens += self._slots(leaf)
                if self._ragged(leaf):
                    node.ragged += 1
                dup.extend(self._absorb_ragged(node, leaf))
                node, pos = leaf, limit
                break
            n = min(_lcp(child.key, key, pos), limit - pos) // p * p
            if n < len(child.key):
                child = self._split(child, n)
            dup.extend(kv[pos + i] for i in range(n) if kv[pos + i] != child.kv[i])
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

    # ------------------------------------------------------------------ checkpoints
    def add_checkpoint(
        self,
        node: Node,
        pos: int,
        handles: Sequence[Optional[int]],
        nbytes: int,
        kind: CheckpointKind = CheckpointKind.CHUNK,
        ready: bool = False,
    ) -> Optional[Checkpoint]:
        """Register (copy or donate) a checkpoint after ``pos`` tokens on the path to ``node``.

        ``handles[g]`` is group g's slot, or None when that group registers later
        (``attach_group_handle``). Returns None when the tree already has a checkpoint at ``pos``:
        the caller keeps (frees) its handles. Not matchable until ``mark_ready``/``commit_step``
        unless ``ready`` (use only when the write is known to have landed)."""
        self._check_attached(node)
        if pos <= 0 or pos % self.hit_unit or pos > node.end:
            raise ValueError(
                f"checkpoint position {pos} must be a positive multiple of "
                f"{self.hit_unit} within the path (<= {node.end})"
            )
        if len(handles) != self.num_groups:
            raise ValueError(f"expected {self.num_groups} group handles, got {len(handles)}")
        holder = node
        while not (holder.start < pos <= holder.end):
            holder = holder.parent  # type: ignore[assignment]
        if pos in holder.checkpoints:
            return None
        for h in handles:
            if h is not None and h in self._handle_owner:
                raise ValueError(f"handle {h} is already held by the tree")
        ck = Checkpoint(
            id=self._new_id(),
            pos=pos,
            handles=list(handles),
            nbytes=nbytes,
            kind=kind,
            node=holder,
            ready=ready,
            last_access=self._tick(),
        )
        holder.checkpoints[pos] = ck
        self._ckpts[ck.id] = ck
        for h in ck.held_handles():
            self._handle_owner[h] = ck
        if not ready:
            self._pending.add(ck.id)
        self.stats.checkpoints += 1
        self.stats.checkpoint_bytes += nbytes
        self._restat(ck)
        return ck

    def attach_group_handle(self, ck: Checkpoint, group: int, handle: int) -> None:
        if ck.id not in self._ckpts or ck.handles[group] is not None or handle in self._handle_owner:
            raise ValueError("cannot attach: checkpoint gone, group already set, or handle held")
        ck.handles[group] = handle
        self._handle_owner[handle] = ck

    def mark_ready(self, ck: Checkpoint) -> None:
        """The copy/donation into ``ck``'s handles has landed: it becomes matchable."""
        ck.ready = True
        self._pending.discard(ck.id)
        self._restat(ck)

    def commit_step(self) -> int:
        """All checkpoints registered so far have landed (call after the step's copies sync)."""
        n = 0
        for cid in list(self._pending):
            ck = self._ckpts.get(cid)
            if ck is not None:
                ck.ready = True
                self._restat(ck)
                n += 1
        self._pending.clear()
        return n

    def checkpoint_of(self, handle: int) -> Optional[Checkpoint]:
        """The checkpoint that holds ``handle`` (any group), or None."""
        return self._handle_owner.get(handle)

    def checkpoint_evictable(self, ck: Checkpoint) -> bool:
        """Not pinned, landed, in the tree, and not protected by a lock on its path."""
        if ck.pins or not ck.ready or ck.node is None:
            return False
        return ck.node.lock_ref == 0 or not self.lock_protects_checkpoints

    def drop_checkpoint(self, ck: Checkpoint, reason: DropReason = DropReason.DROPPED) -> Freed:
        """Remove one boundary, every group at once; its KV stays (pass-through node)."""
        if ck.pins > 0 or not ck.ready:
            raise CheckpointBusy(f"checkpoint at {ck.pos} is pinned or its copy has not landed")
        assert ck.node is not None
        path = None
        if reason is DropReason.EVICTED and self.capture_evicted and not ck.superseded:
            path = self.path_prefix(ck.node, ck.pos)
        del ck.node.checkpoints[ck.pos]
        del self._ckpts[ck.id]
        handles = ck.held_handles()
        for h in handles:
            del self._handle_owner[h]
        ck.node = None  # detached; ck.handles keeps the record of what was handed back
        self._restat(ck)
        self.stats.checkpoints -= 1
        self.stats.checkpoint_bytes -= ck.nbytes
        freed = Freed()
        freed.add_checkpoint(handles, ck.pos, ck.nbytes, reason, ck.kind, path)
        return freed

    def path_checkpoints(self, node: Node) -> list[Checkpoint]:
        """Checkpoints on the path to ``node``, shallowest first."""
        self._check_attached(node)
        out: list[Checkpoint] = []
        for n in self._path(node):
            out.extend(sorted(n.checkpoints.values(), key=lambda c: -c.pos))
        return out[::-1]

    def is_branch_point(self, ck: Checkpoint) -> bool:
        """Placed at a fork (``BRANCH``), or where two or more live paths part. A child that is a
        leaf with no checkpoint and no lock is a dead stub, not a path: its KV can serve no
        restore (e.g. the tail a prompt leaves past its last state, which the same request's
        longer sequence forks off inside a page or replay symbol), so it does not make a fork."""
        n = ck.node
        if ck.kind & CheckpointKind.BRANCH:
            return True
        if n is None or ck.pos != n.end:
            return False
        live = sum(1 for c in n.children.values() if c.children or c.checkpoints or c.lock_ref)
        return live >= 2

    # ------------------------------------------------------------------ eviction
    def saved_flops(self, ck: Checkpoint) -> float:
        """FLOPs a hit at ``ck`` saves over the next-best earlier checkpoint on its path."""
        prev = 0
        for n in self._path(ck.node):  # type: ignore[arg-type]
            earlier = [q for q in n.checkpoints if q < ck.pos]
            if earlier:
                prev = max(earlier)
                break
        return self.policy.flops(prev, ck.pos)

    def expected_saving(self, ck: Checkpoint) -> float:
        """What eviction prices a checkpoint by: the FLOPs one hit saves (:meth:`saved_flops`)
        times ``1 + log2(1 + hits)``. Past hits are the evidence of future ones: a shared system
        prompt's state, hit by every conversation, is worth keeping over a turn end no one has
        come back to, though one hit on it saves less (the frequency term of GreedyDual-Size-
        Frequency, Cherkasova, HP Labs HPL-98-69, 1998). Logarithmic, not linear: on the
        conversation trace a linear ``1 + hits`` took the fixed 64-slot pool (``k3-fixed``)
        from 0.058 to 0.045 at 20-80 GiB, for +0.009 at 40 GiB unified;
        ``benchmarks/results/trace_replay`` has the measured default. Recency stays the other
        term (:func:`~sglang_k3.cache.eviction.rank`), so a once-hot state that went cold still
        ages out.

        A superseded state (kept only for a repeat of its prompt, see
        :meth:`CacheLifecycle._drop_superseded`) is priced at 0 until a hit clears the mark: it
        competes on recency alone, so it goes before any priced state of about its age, but a
        prompt regenerated a few seconds after its answer still finds it while states that went
        cold long ago go first. Strictly first (the rule before) lost nearly every repeat state
        before its regeneration came: on the fork-heavy generator's chat mix (docs/results.md, "Trace
        replay"; ``benchmarks/results/trace_replay_fork_chat``) k3 then trailed Marconi at
        10-40 GiB; the conversation trace moved by less than 0.001."""
        if ck.superseded:
            return 0.0
        return self.saved_flops(ck) * (1 + math.log2(1 + ck.hits))

    def evict(self, num_tokens: int = 0, num_bytes: int = 0, spare_wanted: bool = False) -> Freed:
        """Free at least ``num_bytes`` of checkpoints and ``num_tokens`` of KV where possible;
        with ``spare_wanted`` no checkpoint a waiting request wants goes (room for a new one)."""
        freed = Freed()
        if num_bytes > 0:
            freed.extend(self._evict_checkpoints(num_bytes, spare_wanted))
        if num_tokens > 0:
            freed.extend(self._evict_kv(num_tokens))
        return freed

    def evict_checkpoint(self, ck: Checkpoint) -> Freed:
        """Drop ``ck`` as an eviction (every group; its KV stays) and count it."""
        self.stats.evicted_wanted_checkpoints += bool(self.wanted(ck))
        freed = self.drop_checkpoint(ck, DropReason.EVICTED)
        self.stats.evicted_checkpoints += 1
        self.stats.evicted_checkpoint_bytes += freed.checkpoint_bytes
        return freed

    def _evict_checkpoints(self, need: int, spare_wanted: bool = False) -> Freed:
        freed, got = Freed(), 0
        cands = [
            Candidate(c, c.last_access, self.expected_saving(c), c.nbytes, self.wanted(c))
            for c in self._ckpts.values()
            if self.checkpoint_evictable(c) and not (spare_wanted and self.wanted(c))
        ]
        for cand in rank(cands, self.policy.alpha):
            if got >= need:
                break
            f = self.evict_checkpoint(cand.obj)  # type: ignore[arg-type]
            got += f.checkpoint_bytes
            freed.extend(f)
        return freed

    def _leaves(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def _keep_end(self, leaf: Node) -> int:
        """KV a leaf must keep: up to its last checkpoint, rounded up to a whole page."""
        if not leaf.checkpoints:
            return leaf.start
        p = self.page_size
        return min(leaf.end, -(-max(leaf.checkpoints) // p) * p)

    def _evict_kv(self, need: int) -> Freed:
        freed = Freed()
        while len(freed.kv_indices) < need:
            leaves = [n for n in self._leaves() if n.lock_ref == 0]
            if self._trim_dead_tails(leaves, freed, lambda: len(freed.kv_indices) >= need):
                continue
            whole = [n for n in leaves if all(self.checkpoint_evictable(c) for c in n.checkpoints.values())]
            if not whole:
                break
            cands = [
                Candidate(
                    n,
                    n.last_access,
                    sum(self.expected_saving(c) for c in n.checkpoints.values()),
                    self.policy.kv_bytes(len(n.key)) + n.checkpoint_bytes(),
                    max((self.wanted(c) for c in n.checkpoints.values()), default=0),
                )
                for n in whole
            ]
            for cand in rank(cands, self.policy.alpha):
                if len(freed.kv_indices) >= need:
                    break
                leaf: Node = cand.obj  # type: ignore[assignment]
                for ck in list(leaf.checkpoints.values()):
                    freed.extend(self.evict_checkpoint(ck))
                freed.extend(self._trim_leaf(leaf, leaf.start))
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def evict_ranked(
        self,
        need_bytes: int,
        keep_checkpoints: int = 0,
        group: Optional[Callable[[Checkpoint], int]] = None,
        spare_wanted: bool = False,
    ) -> Freed:
        """Free about ``need_bytes`` of KV and checkpoints together, least valuable first, for a
        budget both draw from. KV past a leaf's last checkpoint is worth nothing (no restore can
        use it) and goes first. Then checkpoints compete, each priced by the prefill FLOPs a hit
        on it saves per byte it keeps alive: its own bytes, plus, for the last checkpoint of an
        unlocked leaf, the leaf's KV that dropping it lets go. So the KV of a cold path can lose
        to a hot checkpoint and the reverse (with recency: the ``alpha`` blend of
        :func:`~sglang_k3.cache.eviction.rank`). ``keep_checkpoints``: never take the checkpoint
        count below this (a floor). ``group``: checkpoints that only free memory together (the
        sub-slots of one block of a unified budget) compete as one candidate and go together, so
        freeing a block takes the cheapest block's checkpoints, not the cheapest checkpoints of
        many blocks. ``spare_wanted``: no checkpoint a waiting request wants goes (the room is
        for a new checkpoint, whose use is a guess: see :meth:`CacheLifecycle.evict_until`)."""
        freed = Freed()
        leaves = [n for n in self._leaves() if n.lock_ref == 0]
        self._trim_dead_tails(leaves, freed, lambda: self.policy.kv_bytes(len(freed.kv_indices)) >= need_bytes)
        got = self.policy.kv_bytes(len(freed.kv_indices))
        cands = []
        if got < need_bytes and self.checkpoint_count() > keep_checkpoints:
            if group is None:
                cands = [self._candidate([c]) for c in self._ckpts.values() if self.checkpoint_evictable(c)]
            else:
                by: dict[int, list[Checkpoint]] = {}
                for c in self._ckpts.values():
                    by.setdefault(group(c), []).append(c)
                cands = [self._candidate(g) for g in by.values() if all(map(self.checkpoint_evictable, g))]
        if spare_wanted:
            cands = [c for c in cands if not c.wanted]
        for cand in rank(cands, self.policy.alpha):
            if got >= need_bytes or self.checkpoint_count() <= keep_checkpoints:
                break
            for ck in cand.obj:  # type: ignore[attr-defined]
                node = ck.node
                if node is None or self.checkpoint_count() <= keep_checkpoints:
                    continue
                f = self.evict_checkpoint(ck)
                f.extend(self._trim_up(node))  # the KV it kept alive
                got += f.checkpoint_bytes + self.policy.kv_bytes(len(f.kv_indices))
                freed.extend(f)
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def _candidate(self, cks: list[Checkpoint]) -> Candidate:
        """Checkpoints that go together, priced as one: the FLOPs their hits save over the bytes
        they keep alive (their own and the KV only they hold), at their newest access."""
        return Candidate(
            cks,
            max(c.last_access for c in cks),
            sum(self.expected_saving(c) for c in cks),
            sum(c.nbytes + self._kv_freed_with(c) for c in cks),
            max(self.wanted(c) for c in cks),
        )

    def rank_checkpoint_groups(self, groups: Sequence[list[Checkpoint]]) -> list[list[Checkpoint]]:
        """``groups`` (each a set of checkpoints that only free memory together, e.g. one state
        slot's blocks) whose checkpoints are all evictable, least valuable first, priced as
        :meth:`evict_ranked` prices them."""
        ok = [g for g in groups if g and all(map(self.checkpoint_evictable, g))]
        return [c.obj for c in rank([self._candidate(g) for g in ok], self.policy.alpha)]  # type: ignore[misc]

    def _kv_freed_with(self, ck: Checkpoint) -> int:
        """KV bytes that dropping ``ck`` lets go: the tail of an unlocked leaf past the checkpoint
        before it (or the whole leaf), when ``ck`` is the leaf's last checkpoint."""
        n = ck.node
        if n is None or not n.is_leaf or n.lock_ref or ck.pos != max(n.checkpoints):
            return 0
        lower = [p for p in n.checkpoints if p < ck.pos]
        return self.policy.kv_bytes(ck.pos - (max(lower) if lower else n.start))

    def trim_dead_tail(self, leaf: Node) -> Freed:
        """Free an unlocked leaf's KV past its last checkpoint (the whole leaf when it has none):
        KV no restore can use. Nothing when ``leaf`` is locked, not a leaf, or has no such KV."""
        self._check_attached(leaf)
        freed = Freed()
        if leaf is self.root or not leaf.is_leaf or leaf.lock_ref or self._keep_end(leaf) >= leaf.end:
            return freed
        freed.extend(self._trim_leaf(leaf, self._keep_end(leaf)))
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def trim_dead_tails(self, enough: Callable[[], bool]) -> Freed:
        """Every unlocked leaf's KV past its last checkpoint, least recently used leaf first, until
        ``enough()`` (:meth:`trim_dead_tail` for all leaves)."""
        freed = Freed()
        self._trim_dead_tails([n for n in self._leaves() if n.lock_ref == 0], freed, enough)
        self.stats.evicted_kv_tokens += len(freed.kv_indices)
        return freed

    def _trim_up(self, node: Node) -> Freed:
        """After ``node`` lost a checkpoint: its dead tail, and when that removes it, its parent's
        while the parent became a leaf with KV past its last checkpoint, up to the next state or
        fork. A turn's path is a chain of nodes (split where later turns and exports matched), so
        dropping its turn-end state frees the whole chain. Counting only the last node's tail, an
        eviction that asked for ~600 KV tokens took five turn ends and freed ~1,600 (the live
        A/B's ``multiturn`` under ``--pressure``), the rest trimmed a round later, uncounted."""
        freed = Freed()
        while node.parent is not None and node.is_leaf and node.lock_ref == 0 and self._keep_end(node) < node.end:
            parent, removed = node.parent, self._keep_end(node) == node.start
            freed.extend(self._trim_leaf(node, self._keep_end(node)))
            if not removed or parent is self.root:
                break
            node = parent
        return freed

    def _trim_dead_tails(self, leaves: list[Node], freed: Freed, enough: Callable[[], bool]) -> bool:
        """KV past a leaf's last checkpoint cannot serve a restore: trim it, least recently used
        leaf first, into ``freed`` until ``enough()``. Returns whether any leaf had such KV."""
        dead = sorted((n for n in leaves if self._keep_end(n) < n.end), key=lambda n: n.last_access)
        for leaf in dead:
            if enough():
                break
            freed.extend(self._trim_leaf(leaf, self._keep_end(leaf)))
        return bool(dead)

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
        if cut == 0:
            assert not leaf.checkpoints
            del parent.children[tuple(leaf.key[: self.page_size])]
            leaf.parent = None
        else:
            leaf.key, leaf.kv = leaf.key[:cut], leaf.kv[:cut]
        freed = Freed()
        freed.add_kv(out)
        return freed

    # ------------------------------------------------------------------ recycle / reset
    def recycle_path(self, node: Node, policy: "PlacementPolicy") -> Freed:  # noqa: F821
        """Drop intermediate checkpoints on ``node``'s path that ``policy`` no longer wants
        (called while the request that owns ``node`` runs)."""
        freed = Freed()
        for ck in policy.select_recyclable(self.path_checkpoints(node), self.is_branch_point):
            if ck.pins == 0 and ck.ready:
                freed.extend(self.drop_checkpoint(ck, DropReason.RECYCLED))
        self.stats.recycled_checkpoints += freed.checkpoints
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
        """Recompute everything from scratch and assert the incremental state agrees (tests)."""
        seen_kv: set[int] = set()
        seen_h: dict[int, Checkpoint] = {}
        ev = pr = nck = nbytes = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            for head, c in n.children.items():
                assert c.parent is n and c.start == n.end and len(c.key) > 0, c
                assert tuple(c.key[: self.page_size]) == head and len(c.key) == len(c.kv)
                assert not self._ragged(c) or c.is_leaf, c  # only a leaf may end inside a page
                assert 0 <= c.lock_ref <= n.lock_ref or n is self.root, (n, c)
                stack.append(c)
            assert n.ragged == sum(map(self._ragged, n.children.values())), n
            if n is self.root:
                continue
            assert n.lock_ref >= 0
            for i in n.kv:
                assert i not in seen_kv, f"KV index {i} held twice"
                seen_kv.add(i)
            if n.lock_ref:
                pr += self._slots(n)
            else:
                ev += self._slots(n)
            for pos, ck in n.checkpoints.items():
                assert ck.pos == pos and ck.node is n and n.start < pos <= n.end and pos % self.hit_unit == 0
                assert ck.pins >= 0 and (ck.pins == 0 or n.lock_ref >= ck.pins)
                assert ck.ready or ck.id in self._pending
                nck += 1
                nbytes += ck.nbytes
                for h in ck.held_handles():
                    assert h not in seen_h, f"handle {h} held twice"
                    seen_h[h] = ck
        assert (ev, pr) == (self._evictable_tokens, self._protected_tokens), (ev, pr)
        assert nck == len(self._ckpts) == self.stats.checkpoints and nbytes == self.stats.checkpoint_bytes
        assert seen_h == self._handle_owner
        stuck = {c.id for c in self._ckpts.values() if not self.checkpoint_evictable(c)}
        assert stuck == self._stuck and self._stuck_bytes == sum(self._ckpts[i].nbytes for i in stuck)
        assert self._stuck_free == {i for i in stuck if not self._ckpts[i].node.lock_ref}
