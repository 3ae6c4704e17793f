"""The replay's peers behave as their sources say (each rule is cited in its policy module):
Marconi keeps no prompt-end state, evicts a one-child node's state alone, and tunes alpha by its
bootstrap replay; vllm-align keeps prefill states at chunk ends only; upstream-int8 keeps its
tree states in an int8 pool of twice the state slots, outside the budget. Small synthetic traces,
no servers."""

from __future__ import annotations

from benchmarks.policies import SimConfig
from benchmarks.policies.marconi import ALPHAS, BOOTSTRAP_MULTIPLIER, MarconiPolicy
from benchmarks.policies.upstream import UpstreamInt8Policy, UpstreamPolicy
from benchmarks.policies.vllm_align import VllmAlignPolicy
from benchmarks.trace import TraceRequest, to_symbolic
from benchmarks.trace_replay import replay
from sglang_k3.cache import CheckpointKind as K
from sglang_k3.cache import preset

GiB = 1 << 30


def _cfg(**kw):
    return SimConfig(cost=preset("kimi-linear-48b"), **kw)


def _trace(rows):
    reqs = [TraceRequest(i + 1, float(t), L, O, tuple(ids)) for i, (t, L, O, ids) in enumerate(rows)]
    return to_symbolic(reqs)


def _conversation(n_conv=6, turns=4, seed_ids=1):
    """``n_conv`` conversations of ``turns`` turns over a shared system block (block 0)."""
    rows, nxt = [], [seed_ids]

    def ids(n):
        out = list(range(nxt[0], nxt[0] + n))
        nxt[0] += n
        return out

    for c in range(n_conv):
        L, O, t = 3000 + 100 * c, 200, 1000 * c
        hs = [0] + ids(-(-L // 512) - 1)
        for _ in range(turns):
            rows.append((t, L, O, hs))
            keep = hs[: L // 512]
            L += O + 700
            hs = keep + ids(-(-L // 512) - len(keep))
            t += 60_000
    rows.sort(key=lambda r: r[0])
    return _trace(rows)


def test_marconi_keeps_no_prompt_end_state():
    tr = _conversation(n_conv=1, turns=1)
    pol = MarconiPolicy(_cfg(), None)
    adm = pol.admit(tr, 0)
    assert pol.tree.checkpoint_count() == 0  # nothing at the prompt end (no branch point either)
    pol.finish(tr, 0, adm.ctx)
    kinds = [c.kind for c in pol.tree.checkpoints()]
    assert kinds == [K.GEN_END]  # the state after the last decoded token only


def test_marconi_evicts_a_one_child_state_alone_and_a_leaf_with_its_kv():
    cfg = _cfg()
    tr = _conversation(n_conv=1, turns=2)
    pol = MarconiPolicy(cfg, None)
    for i in range(2):
        adm = pol.admit(tr, i)
        pol.finish(tr, i, adm.ctx)
    cks = sorted(pol.tree.checkpoints(), key=lambda c: c.pos)
    assert len(cks) == 2  # turn 1's generation end (now one child below it) and turn 2's
    kv_before = pol.tree.total_size()
    pol.tree.policy.alpha = pol.alpha = 0.0
    cks[0].last_access, cks[1].last_access = 1, 2  # the one-child state is the least recent
    assert pol._evict_one()
    assert [c.pos for c in pol.tree.checkpoints()] == [cks[1].pos]
    assert pol.tree.total_size() == kv_before  # its KV stays: it merges into the child
    assert pol._evict_one()  # the leaf's state goes with the leaf's KV
    assert pol.tree.checkpoint_count() == 0 and pol.tree.total_size() < kv_before
    pol.tree.check_invariants()


def test_marconi_alpha_is_lru_until_eviction_then_tuned_over_five_times_the_requests_seen():
    cfg = _cfg()
    tr = _conversation(n_conv=12, turns=4)
    unlimited = MarconiPolicy(cfg, None)
    replay(unlimited, tr, cfg, 400e12, 0.02)
    assert unlimited.alpha == 0.0 and unlimited.window == 0 and unlimited.tuned_alpha is None
    need = max(unlimited.kv_bytes() + unlimited.tree.checkpoint_bytes(), 1)
    tight = MarconiPolicy(cfg, need / 12)
    out = replay(tight, tr, cfg, 400e12, 0.02)
    assert 0 < tight.window <= len(tr) and tight.window % BOOTSTRAP_MULTIPLIER == 0  # measured: 20 of 48
    assert out["alpha_tuned"] and tight.alpha in ALPHAS
    assert set(tight.tuning_scores) == set(ALPHAS)
    assert tight.tuning_scores[tight.alpha] == max(tight.tuning_scores.values())
    roomy = MarconiPolicy(cfg, need / 3)  # first eviction late: 5x that runs past the trace
    out = replay(roomy, tr, cfg, 400e12, 0.02)
    assert roomy.window > len(tr) and roomy.alpha == 0.0 and not out["alpha_tuned"]


def test_vllm_align_prefill_states_at_chunk_ends_only():
    cfg = _cfg(chunked_prefill_size=8192)
    pol = VllmAlignPolicy(cfg, None)
    p = pol.page  # the block in symbols (fp32 states: 1920 tokens)
    assert p * cfg.unit == 1920
    prompt = 100  # symbols = 6400 tokens: one chunk, cut at the last whole block
    assert pol.prefill_chunk_ends(0, prompt) == [prompt // p * p]
    long = 400  # 25,600 tokens: chunks of floor(8192 / 1920) = 4 blocks, then the last whole block
    assert pol.prefill_chunk_ends(0, long) == [4 * p, 8 * p, 12 * p, long // p * p]
    assert len(pol.prefill_chunk_ends(0, long)) < long // p  # not one per block


def test_upstream_int8_keeps_states_in_an_int8_pool_of_twice_the_slots():
    cfg = _cfg()
    budget = 40 * GiB
    up, q = UpstreamPolicy(cfg, budget), UpstreamInt8Policy(cfg, budget)
    r = cfg.upstream_mamba_ratio
    slots = int(budget * r / (1 + r) // cfg.checkpoint_bytes("fp32"))
    assert q.state_pool_bytes == 2 * slots * cfg.checkpoint_bytes("int8")
    assert q.ckpt_nbytes == cfg.checkpoint_bytes("int8") < up.ckpt_nbytes == cfg.checkpoint_bytes("fp32")
    assert q.state_share == up.state_share  # the KV share is unchanged
    tr = _conversation()
    a, b = replay(up, tr, cfg, 400e12, 0.02), replay(q, tr, cfg, 400e12, 0.02)
    assert b["hit_rate"] >= a["hit_rate"] > 0


def test_upstream_hicache_backs_up_every_insert_and_loads_back_what_the_device_evicted():
    """HiCache at its default write-through policy: the host mirror holds what the device tree was
    given (every insert, every state), split as the device's pools; a device that evicted a
    conversation's states restores them from host, paying the load, and the hit rate is at least
    the device-only cache's on the same trace."""
    import pytest

    from benchmarks.policies.upstream_hicache import UpstreamHiCachePolicy

    with pytest.raises(ValueError, match="--host-budget-gib"):
        UpstreamHiCachePolicy(_cfg(), 10 * GiB)
    tr = _conversation(n_conv=6, turns=4)
    one_state = _cfg().checkpoint_bytes("fp32")
    device = 3 * one_state  # room for about one conversation's states: later turns miss on device
    cfg = _cfg(host_budget_bytes=200 * GiB)
    hc = UpstreamHiCachePolicy(cfg, device)
    assert hc.host.state_share == hc.state_share  # H4: the host's pools split as the device's
    up = UpstreamPolicy(_cfg(), device)
    a, b = replay(up, tr, _cfg(), 400e12, 0.02), replay(hc, tr, cfg, 400e12, 0.02)
    host = b["host_tier"]
    assert host["host_loads"] > 0 and host["host_hit_tokens"] > 0 and host["host_load_tokens"] > 0
    assert b["hit_rate"] > a["hit_rate"]
    # every state the device placed is on host too (nothing evicted there at 200 GiB)
    assert hc.host.tree.checkpoint_count() >= hc.ckpt_placed - hc.host_loads > 0
    assert hc.host.tree.stats.evicted_checkpoints == 0
    hc.tree.check_invariants()
    hc.host.tree.check_invariants()
