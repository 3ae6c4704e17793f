"""``python -m sglang_k3.launch_server --help`` shows sglang-k3's flags first, then SGLang's (issue #15)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from sglang_k3.integration.k3_args import add_k3_args

FLAG_LINE = re.compile(r"^  (--[a-z0-9-]+)")


@pytest.fixture(scope="module")
def help_lines() -> list[str]:
    r = subprocess.run(
        [sys.executable, "-m", "sglang_k3.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.splitlines()


def _k3_flags() -> list[str]:
    parser = argparse.ArgumentParser(add_help=False)
    add_k3_args(parser)
    return [opt for a in parser._actions for opt in a.option_strings]


def _flag_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, flag) of each line where an option's help entry starts."""
    return [(i, m.group(1)) for i, line in enumerate(lines) if (m := FLAG_LINE.match(line))]


def test_every_k3_flag_comes_before_sglangs(help_lines):
    entries = _flag_lines(help_lines)
    k3 = [i for i, flag in entries if flag.startswith("--k3-")]
    sglang = [i for i, flag in entries if not flag.startswith("--k3-") and flag != "--help"]
    assert sorted(flag for _, flag in entries if flag.startswith("--k3-")) == sorted(_k3_flags())
    assert {"--model-path", "--tokenizer-path", "--radix-cache-backend"} <= {flag for _, flag in entries}
    assert max(k3) < min(sglang), (help_lines[max(k3)], help_lines[min(sglang)])


def test_k3_heading_is_near_the_top(help_lines):
    assert "sglang-k3:" in help_lines[:40]
    assert help_lines.index("sglang-k3:") < help_lines.index("SGLang options:")


def test_cpu_defaults_leave_upstreams_strategy_to_sglang(monkeypatch):
    """SGLang's own cache gets SGLang's real default (no strategy and no overlap flag added: it
    resolves extra_buffer with the overlap scheduler on); a user who picks no_buffer gets the
    overlap scheduler off, which SGLang asserts there; the cache-off oracle stays no_buffer."""
    from sglang_k3 import launch_server as L

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: True)
    base = ["--model-path", "/m", "--radix-cache-backend", "upstream"]
    plain, _ = L.build_argv(base)
    assert "--disable-overlap-schedule" not in plain and "--mamba-radix-cache-strategy" not in plain
    nb, _ = L.build_argv(base + ["--mamba-radix-cache-strategy", "no_buffer"])
    assert "--disable-overlap-schedule" in nb and nb.count("--mamba-radix-cache-strategy") == 1
    eb, _ = L.build_argv(base + ["--mamba-radix-cache-strategy", "extra_buffer"])
    assert "--disable-overlap-schedule" not in eb and "no_buffer" not in eb
    assert eb.count("--mamba-radix-cache-strategy") == 1
    off, _ = L.build_argv(["--model-path", "/m", "--disable-radix-cache"])
    assert "--disable-overlap-schedule" in off and "no_buffer" in off


def test_k3_runs_with_the_overlap_scheduler_by_default(monkeypatch):
    """k3 guards its state copies by state length, so its default keeps SGLang's overlap scheduler
    on (under no_buffer, through patches/mamba_no_buffer_overlap.py), with one prefill's results
    processed before the next prefill (the export stash holds one prefill's states). A cache-off
    server keeps the CPU default, overlap off; a flag or variable the user gives wins."""
    from sglang_k3 import launch_server as L

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: True)
    monkeypatch.delenv(L.CONSECUTIVE_PREFILL_ENV, raising=False)
    k3, _ = L.build_argv(["--model-path", "/m"])
    assert "--disable-overlap-schedule" not in k3 and "no_buffer" in k3
    assert os.environ[L.CONSECUTIVE_PREFILL_ENV] == "1"
    off, _ = L.build_argv(["--model-path", "/m", "--disable-radix-cache"])
    assert "--disable-overlap-schedule" in off
    mine, _ = L.build_argv(["--model-path", "/m", "--disable-overlap-schedule"])
    assert mine.count("--disable-overlap-schedule") == 1
    monkeypatch.setenv(L.CONSECUTIVE_PREFILL_ENV, "0")
    L.build_argv(["--model-path", "/m"])
    assert os.environ[L.CONSECUTIVE_PREFILL_ENV] == "0"


def test_k3_gets_no_buffer_on_a_gpu_too(monkeypatch):
    """Without the CPU defaults (a CUDA machine), k3 still runs under no_buffer: left to SGLang it
    resolves extra_buffer there, whose per-request ping-pong slots k3 does not manage (on the H200
    they stayed allocated and SGLang's idle pool check stopped the server). SGLang's own cache and a
    cache-off server keep SGLang's resolution; a strategy the user gives is kept (and checked)."""
    from sglang_k3 import launch_server as L

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: False)
    k3, _ = L.build_argv(["--model-path", "/m"])
    assert L._value(k3, "--mamba-radix-cache-strategy") == "no_buffer"
    assert "--device" not in k3 and "--disable-overlap-schedule" not in k3
    for other in (["--radix-cache-backend", "upstream"], ["--disable-radix-cache"]):
        argv, _ = L.build_argv(["--model-path", "/m", *other])
        assert "--mamba-radix-cache-strategy" not in argv, argv
    mine, _ = L.build_argv(["--model-path", "/m", "--mamba-radix-cache-strategy=no_buffer"])
    assert sum(a.startswith("--mamba-radix-cache-strategy") for a in mine) == 1
    with pytest.raises(SystemExit, match="no_buffer"):
        L.build_argv(["--model-path", "/m", "--mamba-radix-cache-strategy", "extra_buffer"])


def test_the_k3_factory_refuses_extra_buffer():
    """Started another way (sglang.launch_server --radix-cache-backend k3 on a GPU, where SGLang
    resolves extra_buffer), the k3 cache stops with the fix instead of leaking state slots."""
    from types import SimpleNamespace

    from sglang_k3.integration.radix_backends import k3_factory

    ctx = SimpleNamespace(
        disable_radix_cache=False,
        is_hybrid_ssm=True,
        server_args=SimpleNamespace(mamba_radix_cache_strategy="extra_buffer"),
    )
    with pytest.raises(ValueError, match="--mamba-radix-cache-strategy no_buffer"):
        k3_factory(ctx)


def test_the_k3_factory_refuses_speculative_decoding_it_cannot_serve(monkeypatch):
    """Started another way (sglang.launch_server --radix-cache-backend k3 --speculative-algorithm
    ...), the k3 cache stops with the reasons, as launch_server does before SGLang starts: an EAGLE
    chain verified at another width than its steps + 1, NEXTN (no MTP layer in the KDA model), and
    on CPU an
    NGRAM draft tree (SGLang's breadth default of 10; the CPU path verifies chains)."""
    from types import SimpleNamespace

    from sglang_k3.integration.radix_backends import k3_factory

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: True)

    def ctx(**spec):
        return SimpleNamespace(
            disable_radix_cache=False,
            is_hybrid_ssm=True,
            server_args=SimpleNamespace(mamba_radix_cache_strategy="no_buffer", **spec),
        )

    with pytest.raises(ValueError, match="--speculative-num-steps 3 --speculative-num-draft-tokens 8: a draft chain"):
        k3_factory(ctx(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_num_draft_tokens=8))
    with pytest.raises(ValueError, match="--speculative-algorithm NEXTN: the k3 cache does not serve with it"):
        k3_factory(ctx(speculative_algorithm="NEXTN"))
    with pytest.raises(ValueError, match="--speculative-ngram-max-bfs-breadth 10: on CPU the k3 cache verifies"):
        k3_factory(ctx(speculative_algorithm="NGRAM", speculative_ngram_max_bfs_breadth=10))


def test_the_no_buffer_overlap_check_is_lifted_for_k3_only():
    """SGLang's own check still refuses no_buffer with the overlap scheduler for its own cache."""
    from types import SimpleNamespace

    from sglang.srt.arg_groups.mamba_hook import validate_mamba_no_buffer

    from sglang_k3.patches.mamba_no_buffer_overlap import validate_no_buffer

    view = dict(page_size=1, disable_overlap_schedule=False, attention_backend="torch_native")
    validate_no_buffer(validate_mamba_no_buffer, SimpleNamespace(radix_cache_backend="k3", **view), "KimiLinear")
    with pytest.raises(AssertionError, match="overlap"):
        validate_no_buffer(
            validate_mamba_no_buffer, SimpleNamespace(radix_cache_backend="upstream", **view), "KimiLinear"
        )
    # k3 keys its states at page boundaries: pages that nest with the 64-token grid pass, others
    # keep upstream's check
    for page in (16, 64, 128, 256):
        k3_view = SimpleNamespace(radix_cache_backend="k3", **{**view, "page_size": page})
        validate_no_buffer(validate_mamba_no_buffer, k3_view, "K")
    with pytest.raises(AssertionError, match="page_size"):
        validate_no_buffer(
            validate_mamba_no_buffer, SimpleNamespace(radix_cache_backend="k3", **{**view, "page_size": 48}), "K"
        )
    with pytest.raises(AssertionError, match="page_size"):
        upstream_view = SimpleNamespace(radix_cache_backend="upstream", **{**view, "page_size": 64})
        validate_no_buffer(validate_mamba_no_buffer, _overlap_off(upstream_view), "K")


def _overlap_off(view):
    view.disable_overlap_schedule = True
    return view


def test_page_sizes_k3_cannot_serve_are_refused_with_the_reason():
    from sglang_k3 import launch_server as L

    for page in ("16", "64", "128", "256"):
        argv, _ = L.build_argv(["--model-path", "/m", "--page-size", page])
        assert argv[argv.index("--page-size") + 1] == page
    for page in ("48", "512", "0"):
        with pytest.raises(SystemExit, match="powers of two up to 256"):
            L.build_argv(["--model-path", "/m", "--page-size", page])
    argv, _ = L.build_argv(["--model-path", "/m", "--page-size", "64", "--k3-host-tier-gib", "1"])  # tiers: any page
    # SGLang's own cache and a cache-off server are not k3's to check
    L.build_argv(["--model-path", "/m", "--page-size", "48", "--radix-cache-backend", "upstream"])
    L.build_argv(["--model-path", "/m", "--page-size", "48", "--disable-radix-cache"])


def test_k3_with_another_state_strategy_is_refused_with_the_reason():
    import pytest

    from sglang_k3 import launch_server as L

    with pytest.raises(SystemExit, match="k3 runs with --mamba-radix-cache-strategy no_buffer"):
        L.build_argv(["--model-path", "/m", "--mamba-radix-cache-strategy=extra_buffer"])


def test_k3_serves_ngram_speculation_and_refuses_the_rest_with_the_reason(monkeypatch, capsys):
    """NGRAM serves with the k3 cache; on CPU its breadth defaults to 1 (draft chains: the CPU
    verify path), and a wider one is refused before SGLang starts. EAGLE and EAGLE3 draft chains
    serve (their defaults and refusals: test_speculative_eagle.py); NEXTN and STANDALONE are
    refused everywhere, with the reason.
    SGLang's own cache and a cache-off server are SGLang's to check; on CPU they get the CPU
    verify's draft chains too (a cache-off EAGLE server given only --speculative-num-steps stopped
    in SGLang's own check with a TypeError)."""
    import pytest

    from sglang_k3 import launch_server as L

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: True)
    argv, cfg = L.build_argv(["--model-path", "/m", "--speculative-algorithm", "NGRAM"])
    assert argv[argv.index("--speculative-ngram-max-bfs-breadth") + 1] == "1" and cfg.unified_memory
    assert "the CPU path verifies draft chains" in capsys.readouterr().err
    argv, _ = L.build_argv(
        ["--model-path", "/m", "--speculative-algorithm=NGRAM", "--speculative-ngram-max-bfs-breadth", "1"]
    )
    assert argv.count("--speculative-ngram-max-bfs-breadth") == 1
    with pytest.raises(SystemExit, match="--speculative-ngram-max-bfs-breadth 4: on CPU the k3 cache verifies"):
        L.build_argv(
            ["--model-path", "/m", "--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "4"]
        )
    for algo in ("NEXTN", "STANDALONE"):
        with pytest.raises(SystemExit, match=f"--speculative-algorithm {algo}: the k3 cache does not serve with it"):
            L.build_argv(["--model-path", "/m", "--speculative-algorithm", algo])
        L.build_argv(["--model-path", "/m", "--speculative-algorithm", algo, "--disable-radix-cache"])  # SGLang's
    off = ["--model-path", "/m", "--disable-radix-cache", "--speculative-algorithm", "EAGLE"]
    argv, _ = L.build_argv(off + ["--speculative-draft-model-path", "/d", "--speculative-num-steps", "3"])
    got = {f: argv[argv.index(f) + 1] for f in ("--speculative-eagle-topk", "--speculative-num-draft-tokens")}
    assert got == {"--speculative-eagle-topk": "1", "--speculative-num-draft-tokens": "4"}, argv
    argv, _ = L.build_argv(
        ["--model-path", "/m", "--radix-cache-backend", "upstream", "--speculative-algorithm", "NGRAM"]
    )
    assert argv[argv.index("--speculative-ngram-max-bfs-breadth") + 1] == "1"
    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: False)
    gpu, cfg = L.build_argv(["--model-path", "/m", "--speculative-algorithm", "NGRAM"])
    assert "--speculative-ngram-max-bfs-breadth" not in gpu  # SGLang's trees on a GPU
    assert not cfg.unified_memory  # fixed pools: the GPU verify ran faster there
    assert "the verify ran slower over the unified buffer" in capsys.readouterr().err
    argv, _ = L.build_argv(
        ["--model-path", "/m", "--speculative-algorithm", "EAGLE", "--radix-cache-backend", "upstream"]
    )
    assert argv[argv.index("--speculative-algorithm") + 1] == "EAGLE"
    L.build_argv(["--model-path", "/m", "--speculative-algorithm=EAGLE", "--disable-radix-cache"])


def test_host_tier_flags_are_checked_before_the_server_starts():
    from sglang_k3.integration.k3_args import from_namespace

    parser = argparse.ArgumentParser()
    add_k3_args(parser)
    bad = {
        "finite number >= 0": ["--k3-host-tier-gib", "-1"],
    }
    for msg, argv in bad.items():
        with pytest.raises(SystemExit, match=msg):
            from_namespace(parser.parse_args(argv))
    with pytest.raises(SystemExit):  # argparse: not one of SGLang's policy names
        parser.parse_args(["--k3-tier-write-policy", "write_sometimes"])
    cfg = from_namespace(parser.parse_args(["--k3-host-tier-gib", "2.5", "--k3-tier-write-policy", "write_through"]))
    assert (cfg.host_tier_gib, cfg.tier_write_policy) == (2.5, "write_through")
    assert from_namespace(parser.parse_args([])).host_tier_gib == 0  # off by default


def test_a_disaggregated_cpu_prefill_takes_the_plain_transfer_path_without_overlap(monkeypatch):
    """--disaggregation-mode prefill|decode keeps unified memory (the transfer moves whole pages
    and slots of its one buffer: unified_memory.describe_for_transfer). On a CPU prefill the
    transfer takes its plain (non-CUDA) path and, with the k3 cache, the overlap scheduler is off
    (a prefix hit would record a CUDA event there). A non-PD server is unchanged; what the user
    gives wins."""
    from sglang_k3 import launch_server as L

    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: True)
    monkeypatch.delenv(L.PD_CPU_PREFILL_ENV, raising=False)
    plain, cfg = L.build_argv(["--model-path", "/m"])
    assert cfg.unified_memory and "--disable-overlap-schedule" not in plain
    assert L.PD_CPU_PREFILL_ENV not in os.environ
    pd = ["--model-path", "/m", "--disaggregation-transfer-backend", "mooncake_tcp"]
    pre, cfg = L.build_argv(pd + ["--disaggregation-mode", "prefill"])
    assert cfg.unified_memory and "--disable-overlap-schedule" in pre
    assert os.environ[L.PD_CPU_PREFILL_ENV] == "1"
    monkeypatch.delenv(L.PD_CPU_PREFILL_ENV)
    dec, cfg = L.build_argv(pd + ["--disaggregation-mode=decode"])
    assert cfg.unified_memory and L.PD_CPU_PREFILL_ENV not in os.environ
    assert "--disable-overlap-schedule" not in dec
    off, cfg = L.build_argv(pd + ["--disaggregation-mode", "prefill", "--disable-radix-cache"])
    assert off.count("--disable-overlap-schedule") == 1  # the cache-off CPU default, once
    monkeypatch.setattr("sglang_k3.integration.platform_entry.cpu_platform_wanted", lambda: False)
    monkeypatch.delenv(L.PD_CPU_PREFILL_ENV, raising=False)
    gpu, cfg = L.build_argv(pd + ["--disaggregation-mode", "prefill"])
    assert cfg.unified_memory and "--disable-overlap-schedule" not in gpu
    assert L.PD_CPU_PREFILL_ENV not in os.environ
