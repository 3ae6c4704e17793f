"""The embedded model's cache directory repairs itself and never keeps build debris (issue #15).

Unit tests, no server: ``default_model_path`` with ``SGLANG_K3_HOME`` set to a temporary
directory. A small spec keeps each build well under a second; the logic does not depend on size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from sglang_k3.model import tiny_build
from sglang_k3.model.tiny_build import ENV_HOME, LOCK, MANIFEST, default_model_path, verify
from sglang_k3.model.tiny_spec import TinyK3Spec

SPEC = TinyK3Spec(
    hidden_size=32,
    num_layers=4,
    kda_heads=1,
    kda_head_dim=16,
    mla_heads=1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    num_experts=2,
    moe_intermediate_size=16,
    intermediate_size=32,
)


@pytest.fixture
def home(tmp_path, monkeypatch):
    root = tmp_path / "home"
    monkeypatch.setenv(ENV_HOME, str(root))
    return root


@pytest.fixture(scope="module")
def fresh_manifest(tmp_path_factory) -> dict:
    """The manifest of a build made from scratch, which a repaired directory must equal."""
    out = tiny_build.build(str(tmp_path_factory.mktemp("fresh")), SPEC)
    with open(os.path.join(out, MANIFEST)) as f:
        return json.load(f)


def _entries(home) -> list[str]:
    """What the cache root holds besides its install lock (which stays, by design)."""
    return sorted(set(os.listdir(home)) - {LOCK})


def _manifest(path) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def _truncate_weights(p):
    with open(os.path.join(p, "model.safetensors"), "r+b") as f:
        f.truncate(os.path.getsize(f.name) // 2)


def _flip_weight_byte(p):
    with open(os.path.join(p, "model.safetensors"), "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


DAMAGE = {
    "tokenizer deleted": (lambda p: os.remove(os.path.join(p, "tokenizer.json")), "tokenizer.json is missing"),
    "weights truncated": (_truncate_weights, "model.safetensors has"),
    "weights bit flip": (_flip_weight_byte, "model.safetensors does not match its sha256"),
    "manifest deleted": (lambda p: os.remove(os.path.join(p, MANIFEST)), f"{MANIFEST} is missing"),
}


def test_first_build_verifies_matches_a_fresh_build_and_leaves_nothing_else(home, fresh_manifest):
    path = default_model_path(SPEC)
    assert verify(path, SPEC) is None
    assert _manifest(path) == fresh_manifest
    assert _entries(home) == [os.path.basename(path)]


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damaged_directory_is_rebuilt(home, fresh_manifest, capsys, damage):
    path = default_model_path(SPEC)
    harm, reason = DAMAGE[damage]
    harm(path)
    assert verify(path, SPEC) is not None
    capsys.readouterr()

    assert default_model_path(SPEC) == path
    err = capsys.readouterr().err
    assert "rebuilding the embedded model" in err and reason in err, err
    assert verify(path, SPEC) is None
    assert _manifest(path) == fresh_manifest
    assert _entries(home) == [os.path.basename(path)]


def test_other_users_can_read_the_cache(home):
    # Even under a private umask: the modes are set, not inherited (mkdtemp made the directory
    # 0700 and safetensors the weights 0600).
    previous = os.umask(0o077)
    try:
        path = default_model_path(SPEC)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    for name in os.listdir(path):
        assert stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode) == 0o644, name


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_killed_builds_are_removed_and_live_builds_kept(home):
    home.mkdir()
    stale = [".building-xyz", f".building-{_dead_pid()}-0a1b2c3d", ".discard-0a1b2c3d"]
    live = f".building-{os.getpid()}-0a1b2c3d"  # a build in progress in a running process
    for name in stale + [live]:
        (home / name).mkdir()
        (home / name / "config.json").write_text("{}")

    path = default_model_path(SPEC)
    assert _entries(home) == sorted([os.path.basename(path), live])


def test_failed_build_leaves_no_building_directory(home):
    # A negative dimension fails inside make_weights, after config.json has been written.
    bad = dataclasses.replace(SPEC, kda_head_dim=-1)
    with pytest.raises(RuntimeError):
        default_model_path(bad)
    assert _entries(home) == []


def test_concurrent_starts_on_a_broken_directory_agree(home, fresh_manifest, tmp_path):
    path = default_model_path(SPEC)
    os.remove(os.path.join(path, "tokenizer.json"))
    go = tmp_path / "go"
    # Each process imports first, then waits for the same signal, so the repairs overlap.
    code = textwrap.dedent(f"""
        import os, time
        from sglang_k3.model.tiny_build import default_model_path
        from sglang_k3.model.tiny_spec import TinyK3Spec
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print(default_model_path(TinyK3Spec(**{dataclasses.asdict(SPEC)!r})))
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert {out.strip() for out, _ in outs} == {path}
    assert verify(path, SPEC) is None
    assert _manifest(path) == fresh_manifest
    assert _entries(home) == [os.path.basename(path)]


def test_kda_decay_range_sets_every_heads_decay_rate():
    """The decay range is what the weights hold: the default [1, 16) (a few tokens of memory),
    and a long-memory range (the GPU differential's model) whose heads keep a state for hundreds
    of tokens. Everything else in the weights is the same draw."""
    from sglang_k3.model.tiny_weights import make_weights

    base = make_weights(SPEC)
    long = make_weights(dataclasses.replace(SPEC, kda_decay_min=0.002, kda_decay_max=0.5))
    a_logs = [k for k in base if k.endswith(".A_log")]
    assert a_logs
    for k in a_logs:
        assert ((base[k].exp() >= 1.0) & (base[k].exp() < 16.0)).all()
        assert ((long[k].exp() >= 0.002) & (long[k].exp() < 0.5)).all()
    assert all(base[k].equal(long[k]) for k in base if k not in a_logs)


def test_make_tiny_k3_refuses_an_empty_decay_range(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/make_tiny_k3.py",
            "--out",
            str(tmp_path / "m"),
            "--kda-decay-min",
            "2",
            "--kda-decay-max",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 2 and "kda_decay_min < kda_decay_max" in proc.stderr
    assert not (tmp_path / "m").exists()
