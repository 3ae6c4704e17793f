"""Observability of the k3 cache: ``/server_info``'s ``k3_cache`` entry, the ``sglang_k3_*``
Prometheus series and the per-request ``meta_info`` fields, through one real server
(``--enable-metrics``), plus unit checks of the pieces that need no server."""

from __future__ import annotations

import math
import random
import re
import time
from types import SimpleNamespace

import pytest
import requests

from sglang_k3.cache.ghosts import MISS_CAUSES
from sglang_k3.integration import observability as obs

PRINTABLE = list(range(32, 127))


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.choice(PRINTABLE) for _ in range(n)]


def _k3_state(s) -> dict:
    r = requests.get(s.url + "/server_info", timeout=60)
    r.raise_for_status()
    states = r.json()["internal_states"]
    assert len(states) == 1
    return states[0][obs.SERVER_INFO_KEY]


_SERIES = re.compile(r"^(sglang_k3_[a-z0-9_]+)(\{[^}]*\})?\s+(\S+)$")


def _k3_metrics(s) -> dict[str, float]:
    r = requests.get(s.url + "/metrics", timeout=60)
    r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = _SERIES.match(line)
        if m:
            assert m.group(1) not in out, f"{m.group(1)} exported twice"
            out[m.group(1)] = float(m.group(3))
    return out


def _k3_fields(out: dict) -> tuple[int, int, int]:
    mi = out["meta_info"]
    vals = []
    for key in (obs.META_RESTORE_LEN, obs.META_REPLAYED_TOKENS, obs.META_KV_MATCH_LEN):
        assert key in mi, f"meta_info lacks {key}: {sorted(mi)}"
        assert isinstance(mi[key], list) and len(mi[key]) == 1, (key, mi[key])
        vals.append(mi[key][0])
    return tuple(vals)  # type: ignore[return-value]


@pytest.fixture(scope="module")
def exchange(server_factory):
    """A multi-turn exchange on a flushed cache: turn 2 extends turn 1 (a hit at the turn
    boundary); a third request shares only the first 250 tokens of turn 1's prompt, and its
    nearest checkpoint is earlier (tokens replayed)."""
    s = server_factory("k3_metrics")
    s.flush_cache()  # retried: SGLang refuses while the last request is being retired
    before = _k3_state(s)
    rng = random.Random(2024)
    p1 = _tokens(rng, 300)
    t1 = s.generate(p1, 8)
    p2 = p1 + t1["output_ids"] + _tokens(rng, 50)
    t2 = s.generate(p2, 8)
    branch = [t for t in PRINTABLE if t != p1[250]]
    p3 = p1[:250] + [rng.choice(branch)] + _tokens(rng, 19)
    t3 = s.generate(p3, 8)
    # Before any /server_info call (which also refreshes the series): the series must follow
    # the cache by themselves, refreshed after each processed batch.
    want_lookups = before["lookups"] + 3
    deadline = time.time() + 15
    metrics = _k3_metrics(s)
    while metrics.get("sglang_k3_lookups_total") != want_lookups and time.time() < deadline:
        time.sleep(0.2)
        metrics = _k3_metrics(s)
    return SimpleNamespace(server=s, before=before, prompts=[p1, p2, p3], outs=[t1, t2, t3], metrics_after=metrics)


def test_per_request_fields(exchange):
    (r1, rep1, kv1), (r2, rep2, kv2), (r3, rep3, kv3) = (_k3_fields(o) for o in exchange.outs)
    p1, p2, p3 = exchange.prompts
    for out, (restore, replayed, kv_match), prompt in zip(
        exchange.outs, ((r1, rep1, kv1), (r2, rep2, kv2), (r3, rep3, kv3)), exchange.prompts
    ):
        assert restore == out["meta_info"]["cached_tokens"]
        # Replayed: KV present (capped so one token is left to compute) above the restore point.
        assert replayed == min(kv_match, len(prompt) - 1) - restore
    assert (r1, rep1, kv1) == (0, 0, 0)  # flushed cache: a plain miss
    assert r2 > 0 and kv2 >= len(p1)  # the next turn resumes at the previous turn's boundary
    assert kv3 == 250  # exactly the shared prefix has KV in the tree
    assert r3 < 250 and rep3 > 0  # ...but the nearest checkpoint is earlier: the rest is replayed


def test_server_info_k3_cache(exchange):
    s = exchange.server
    info = _k3_state(s)
    before = exchange.before
    restores = [_k3_fields(o)[0] for o in exchange.outs]
    replays = [_k3_fields(o)[1] for o in exchange.outs]
    assert info["lookups"] - before["lookups"] == 3
    assert info["hit_tokens"] - before["hit_tokens"] == sum(restores) > 0
    assert info["replayed_tokens"] - before["replayed_tokens"] == sum(replays) > 0
    assert info["token_hit_rate"] == pytest.approx(info["hit_tokens"] / info["requested_tokens"])
    assert 0 < info["token_hit_rate"] < 1
    assert info["checkpoint_count"] > 0
    assert info["checkpoint_slot_bytes"] > 0
    assert info["checkpoint_bytes"] == info["checkpoint_count"] * info["checkpoint_slot_bytes"]
    assert info["kv_tokens"] >= len(exchange.prompts[1])
    for key in ("evicted_kv_tokens", "evicted_checkpoints", "evicted_checkpoint_bytes"):
        assert info[key] >= 0
    # every looked-up token is restored or counted by the cause that it was not
    misses = [info[f"miss_{c}_tokens"] for c in MISS_CAUSES]
    assert min(misses) >= 0 and sum(misses) == info["requested_tokens"] - info["hit_tokens"], info


def test_metrics_match_server_info(exchange):
    s = exchange.server
    fresh = exchange.metrics_after  # read before any /server_info call after the exchange
    assert fresh.get("sglang_k3_lookups_total") == exchange.before["lookups"] + 3, fresh
    info = _k3_state(s)
    metrics = _k3_metrics(s)
    expected = {obs.metric_name(f) for f in (*obs.GAUGES, *obs.COUNTERS)}
    assert set(metrics) == expected
    for field in (*obs.GAUGES, *obs.COUNTERS):
        assert math.isclose(metrics[obs.metric_name(field)], info[field], rel_tol=1e-9), field
    assert metrics["sglang_k3_checkpoint_count"] > 0
    assert metrics["sglang_k3_hit_tokens_total"] > 0


# ---------------------------------------------------------------------------- no server
def test_metric_names():
    assert obs.metric_name("checkpoint_bytes") == "sglang_k3_checkpoint_bytes"
    assert obs.metric_name("evicted_checkpoints") == "sglang_k3_evicted_checkpoints_total"
    assert not set(obs.GAUGES) & set(obs.COUNTERS)


def test_streamer_emits_once_per_request():
    class Base:
        def build_additional_customized_info(self, reqs):
            return {"other": [[1]] * len(reqs)}

    cls = obs.streamer_class(Base)
    assert obs.streamer_class(Base) is cls and cls.has_additional_customized_info
    hit = SimpleNamespace(k3_match=obs.ReqMatch(128, 22, 150))
    plain = SimpleNamespace()  # a request the k3 hook never saw
    first = cls().build_additional_customized_info([hit, plain])
    assert first["other"] == [[1], [1]]
    assert first[obs.META_RESTORE_LEN] == [[128], []]
    assert first[obs.META_REPLAYED_TOKENS] == [[22], []]
    assert first[obs.META_KV_MATCH_LEN] == [[150], []]
    again = cls().build_additional_customized_info([hit])
    assert again[obs.META_RESTORE_LEN] == [[]]  # already sent with an earlier chunk
