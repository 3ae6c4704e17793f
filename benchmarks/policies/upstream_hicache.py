"""``upstream-hicache``: SGLang 0.5.23's hybrid cache (``upstream``, rules 1-8 there) with its host
tier, HiCache (``--enable-hierarchical-cache``), at its default write policy, replayed beside k3's
own host tier at the same host bytes (``--host-budget-gib``). Paths are relative to
``sglang/srt/`` of the pinned install.

Rules, each with its source:

H1. **Hybrid models get HiCache.** ``UnifiedRadixCache`` (FULL + MAMBA components) attaches it in
    ``init_hicache`` (mem_cache/registry.py:192-196, unified_radix_cache.py:455-591), with an MLA
    host pool and a separate ``MambaPoolHost`` of full-size states in the device pool's dtypes
    (hybrid_cache/hybrid_pool_assembler.py:1278-1413, mem_cache/pool_host/mamba.py). int8
    checkpoints are refused with it (arg_groups/mamba_hook.py:83-88): states are fp32 here.
H2. **Write-through: everything inserted is backed up.** ``--hicache-write-policy`` defaults to
    ``write_through`` (arg_groups/fields/memory.py:121-127), whose threshold is one hit
    (unified_radix_cache.py:558-560), and hits are counted on insert (unified_tree_core.py:
    1104-1122, 1368-1373, 1430-1441), so every node a chunk checkpoint or a finish inserts is
    written to host, ancestors first (unified_tree_core.py:2622-2644), with the state at its end
    (unified_tree_core.py:2509-2526, components/mamba.py:871-881). Modelled as a mirror tree on
    host: the same inserts, the same states.
H3. **Device eviction demotes.** A backed-up leaf loses its device KV and state and stays on host
    (unified_tree_core.py:2090-2123): the device tree evicts as ``upstream`` does; the mirror keeps
    its copy.
H4. **Host pools split as the device's.** ``--hicache-size`` S is split by the device pools' bytes
    (hybrid_pool_assembler.py:239-254, 1318-1322); by ratio, each pool is the device pool times the
    ratio (pool_host/base.py:220-229, pool_host/mamba.py:166-174): the same proportions either way,
    so the host's states get ``ratio / (1 + ratio)`` of the host bytes, as ``upstream``'s device.
H5. **Host eviction is LRU over host-only leaves**, KV and state together
    (components/full.py:250-276, unified_tree_core.py:2046-2075); under mamba host pressure an
    internal node loses its state and keeps its KV (components/mamba.py:1012-1069). The mirror's
    tree evicts LRU (``alpha = 0``) with the split pools, as the device's.
H6. **A match reaches host.** It walks through evicted, backed-up nodes, and its best node needs
    KV on device or host and a state on device or host at that node's end (components/full.py:
    110-145, components/mamba.py:151-189); the KV-hit length that places the branch-point state
    counts host KV (components/mamba.py:174-183). The evicted KV on the path and the state are
    loaded back before the forward (schedule_policy.py:1478-1525, unified_radix_cache.py:1820-1928,
    components/mamba.py:883-911) into the device node: the device tree gets the loaded boundary's
    KV and a state there. The load time is its bytes at ``--host-gbps``.

Deviations (stated): host copies of nodes still on the device cannot be evicted upstream
(unified_tree_core.py:2366-2387); the mirror evicts by recency alone, which keeps the most
recently used, so what is on the device is almost always on host too (the host holds 2x the
device by default, hicache_auto_size.py). The mamba host LRU is ordered by demotion time upstream,
by access here. Loads under 10 tokens are skipped upstream (unified_radix_cache.py:576, 1879);
here a load is at least one 64-token symbol.
"""

from __future__ import annotations

from benchmarks.policies.base import SimConfig
from benchmarks.policies.upstream import UpstreamPolicy
from sglang_k3.cache import CheckpointKind


class UpstreamHiCachePolicy(UpstreamPolicy):
    name = "upstream-hicache"

    def __init__(self, cfg: SimConfig, budget_bytes):
        if not cfg.host_budget_bytes:
            raise ValueError("upstream-hicache models a host tier: give it --host-budget-gib (its host bytes)")
        super().__init__(cfg, budget_bytes)
        self.host = UpstreamPolicy(cfg, cfg.host_budget_bytes)  # H4: split as the device's pools
        self.host_loads = 0
        self.host_load_tokens = 0  # real tokens whose KV came back from host
        self.host_hit_tokens = 0  # real tokens of restores from a host-only state

    # ------------------------------------------------------------------ the mirror (H2)
    def backed_up(self, seq, end: int, plan: dict, running: bool):
        """Back up what the device tree just took: the same key up to ``end``, the same states (a
        state already on host, one a load brought back, is not placed twice)."""
        if end <= 0:
            return None
        res = self.host.tree.insert(seq[:end], self.host._kv(end))
        node = None if res.node is self.host.tree.root else res.node
        if node is not None:
            if running:
                self.host.tree.inc_lock_ref(node)  # the running request's path is not host-only
            self.host._place(node, plan)
        self.host.enforce_budget()
        return node

    def release_backup(self, backup) -> None:
        if backup is not None:
            self.host.tree.dec_lock_ref(backup)

    # ------------------------------------------------------------------ a match reaches host (H6)
    def lower_tier_hit(self, key, m, restore: int):
        hm = self.host.tree.match_prefix(key, pin=False)  # the walk goes on through host nodes
        mla = max(m.mla_len, hm.mla_len)
        if hm.restore_len <= restore:
            return restore, mla, {}, 0.0
        # a deeper state on host, loaded back with the evicted KV before it
        kv_back = hm.restore_len - min(m.mla_len, hm.restore_len)
        nbytes = kv_back * self.cfg.kv_bytes_per_symbol + self.ckpt_nbytes
        self.host_loads += 1
        self.host_load_tokens += kv_back * self.cfg.unit
        self.host_hit_tokens += (hm.restore_len - restore) * self.cfg.unit
        # the loaded state lands in the device node
        return hm.restore_len, mla, {hm.restore_len: CheckpointKind.CHUNK}, nbytes / (self.cfg.host_gbps * 1e9)

    def summary(self) -> dict:
        d = super().summary()
        d["host_tier"] = {
            "host_budget_bytes": self.cfg.host_budget_bytes,
            "host_kv_bytes": self.host.kv_bytes(),
            "host_state_bytes": self.host.tree.checkpoint_bytes(),
            "host_loads": self.host_loads,
            "host_load_tokens": self.host_load_tokens,
            "host_hit_tokens": self.host_hit_tokens,
        }
        return d
