"""The replay's ``k3`` is the server's ``k3`` by construction: from the flags ``launch_server``
parses with no ``--k3-*`` flag, the server's cache (built on real SGLang pools on the CPU) and the
replay's policy get the same config, the same tree flags, placement, eviction alpha and checkpoint
capacity, and a non-default flag reaches both the same way."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from sglang_k3.cache.build import placement_from_config
from sglang_k3.cache.lifecycle import CacheLifecycle
from sglang_k3.config import K3Config
from sglang_k3.integration.k3_args import add_k3_args, from_namespace


def _parsed(argv: list[str]) -> K3Config:
    p = argparse.ArgumentParser()
    add_k3_args(p)
    return from_namespace(p.parse_args(argv))


def _server_cache(cfg: K3Config):
    pytest.importorskip("sglang")
    from cpu_pools import k3_cache_on_cpu, unified_k3_cache_on_cpu

    if cfg.unified_memory:  # as the server builds it: SGLang's pools, then the unified install
        return unified_k3_cache_on_cpu(cfg)[0]
    return k3_cache_on_cpu(cfg)


def _replay_policy(cfg: K3Config, unit: int = 64):
    from benchmarks.policies import SimConfig
    from benchmarks.policies.k3 import K3Policy
    from sglang_k3.cache import preset

    return K3Policy(SimConfig(cost=preset("kimi-linear-48b"), unit=unit), 40 << 30, k3=cfg)


def _shape(lc: CacheLifecycle) -> dict:
    t = lc.tree
    return dict(
        num_groups=t.num_groups,
        page_size=t.page_size,
        hit_unit=t.hit_unit,
        lock_protects_checkpoints=t.lock_protects_checkpoints,
        alpha=t.policy.alpha,
    )


def test_default_flags_give_the_same_objects_to_server_and_replay():
    cfg = _parsed([])
    assert cfg == K3Config()  # the flags' defaults are the config's defaults
    server = _server_cache(cfg)
    replay = _replay_policy(cfg)
    assert server.cfg == replay.k3 == cfg
    assert _shape(server.lifecycle) == _shape(replay.lifecycle)
    assert server.lifecycle.placement == placement_from_config(cfg, 1)
    assert replay.lifecycle.placement == placement_from_config(cfg, 64)
    # the same placement but for the unit: the decode interval in symbols of 64 tokens
    assert (
        dataclasses.replace(replay.lifecycle.placement, decode_interval=server.placement.decode_interval)
        == server.placement
    )
    # memory as the server holds it: int8 checkpoints, MLA KV and active states in one budget,
    # one ledger class cut by the same plan_geometry (sizes differ: a tiny model vs 48B)
    assert server.store.dtype == replay.store.dtype == "int8"
    assert server.unified is not None and replay.ledger is not None and replay.store.capacity is None
    assert type(server.ledger) is type(replay.ledger)
    for led in (server.ledger, replay.ledger):
        assert led.geom.ckpt_per_block * led.geom.ckpt_stride == led.geom.block_bytes
        assert led.max_checkpoints == 0 and led.min_kv_tokens == 0


def test_a_flag_reaches_both_alike():
    cfg = _parsed(
        [
            "--k3-checkpoint-budget",
            "3",
            "--k3-no-branch-checkpoints",
            "--k3-checkpoint-slots",
            "5",
            "--k3-decode-checkpoint-interval",
            "0",
            "--k3-no-unified-memory",
        ]
    )
    server, replay = _server_cache(cfg), _replay_policy(cfg)
    for lc in (server.lifecycle, replay.lifecycle):
        assert lc.placement.per_path_budget == 3
        assert lc.placement.at_branch_points is False
        assert lc.placement.decode_interval is None
    assert server.store.pool.num_slots == replay.store.capacity == 5
    assert replay.ledger is None and getattr(server, "unified", None) is None


def test_unified_floors_and_caps_reach_both_alike():
    cfg = _parsed(["--k3-max-checkpoints", "7", "--k3-min-kv-tokens", "128"])
    server, replay = _server_cache(cfg), _replay_policy(cfg)
    assert server.ledger.max_checkpoints == replay.ledger.max_checkpoints == 7
    assert server.ledger.min_kv_tokens == 128 and replay.ledger.min_kv_tokens == 128 // 64  # in symbols
