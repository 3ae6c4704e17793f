"""``python -m sglang_k3.launch_server``: SGLang's own server with sglang-k3's cache and defaults.

Every ``sglang.launch_server`` flag passes through unchanged; ``--help`` lists ours first, then them.
With no ``--model-path``, the embedded tiny K3-architecture model is built (once) and served.
On a machine without CUDA the CPU serving defaults are added; any flag you give wins.
Speculative decoding with the k3 cache: NGRAM, and EAGLE / EAGLE3 with a draft model
(--speculative-draft-model-path) and draft chains (--speculative-eagle-topk 1; on CPU one draft
step a verify unless --speculative-num-steps says more); the rest is refused with the reason
(docs/user_guide.md, "Speculative decoding").
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang_k3.integration.k3_args import K3Config, add_k3_args, from_namespace

PROG = "python -m sglang_k3.launch_server"
USAGE = "%(prog)s [-h] [sglang-k3 options] [SGLang options]"
SGLANG_HEADING = "SGLang options"
SGLANG_POINTER = (
    "The options of sglang.launch_server, passed through unchanged\n"
    "(`python -m sglang.launch_server --help` lists the same)."
)

# Defaults that make the hybrid KDA/MLA path serve on CPU (docs/user_guide.md, "Serving").
CPU_DEFAULTS: list[tuple[str, str | None]] = [
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--max-total-tokens", "8192"),
    ("--skip-server-warmup", None),
    ("--mamba-radix-cache-strategy", "no_buffer"),
    ("--disable-overlap-schedule", None),
    ("--max-mamba-cache-size", "32"),
    # An idle scheduler otherwise spins a core; several CPU servers on one machine starve.
    ("--sleep-on-idle", None),
]
# The embedded model is an fp32 checkpoint; kimi_linear builds one projection with the config
# dtype, so `--dtype auto` would mix dtypes.
EMBEDDED_MODEL_DEFAULTS: list[tuple[str, str | None]] = [("--dtype", "float32")]
CONSECUTIVE_PREFILL_ENV = "SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP"
# sglang-k3's cache is the default; `--radix-cache-backend upstream` selects SGLang's own.
CACHE_DEFAULTS: list[tuple[str, str | None]] = [("--radix-cache-backend", "k3")]
# What the k3 cache needs on every device: it takes its states itself under `no_buffer`. Left
# unset, SGLang resolves `extra_buffer` on a GPU (arg_groups/overrides.py), whose per-request
# ping-pong slots k3 does not manage: they stayed allocated after every request and SGLang's
# idle pool check stopped the server (seen on the H200, benchmarks/GPU_NOTES.md).
K3_DEFAULTS: list[tuple[str, str | None]] = [("--mamba-radix-cache-strategy", "no_buffer")]


def _given(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _with_defaults(argv: list[str], defaults: list[tuple[str, str | None]]) -> list[str]:
    out = list(argv)
    for flag, value in defaults:
        if not _given(argv, flag):
            out += [flag] if value is None else [flag, value]
    return out


def _value(argv: list[str], flag: str) -> str | None:
    """The value given for ``flag`` (``--flag v`` or ``--flag=v``), or None."""
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _k3_serves(argv: list[str]) -> bool:
    """The k3 cache serves: it is the backend and the cache is not off (SGLang's own cache and a
    cache-off server are not k3's to check or to default)."""
    return _value(argv, "--radix-cache-backend") == "k3" and not _given(argv, "--disable-radix-cache")


def _cpu_defaults_for(argv: list[str]) -> list[tuple[str, str | None]]:
    """The CPU defaults, less what SGLang should decide itself:

    * k3: ``no_buffer`` (k3 takes its states itself) with the overlap scheduler on
      (``patches/mamba_no_buffer_overlap.py``), as SGLang runs by default;
    * SGLang's own cache with no strategy given: neither strategy nor overlap is added, so SGLang
      resolves its real default (``arg_groups/overrides.py::_mamba_radix_cache_resolution``:
      ``extra_buffer`` with the overlap scheduler on, which runs on CPU through
      ``patches/mamba_track_states.py``);
    * ``no_buffer`` given for SGLang's own cache, or a cache-off server: the overlap scheduler off
      (SGLang asserts it for ``no_buffer``, ``arg_groups/mamba_hook.py::validate_mamba_no_buffer``;
      the cache-off server is the differential tests' oracle and stays as it was)."""
    strategy = _value(argv, "--mamba-radix-cache-strategy")
    backend = _value(argv, "--radix-cache-backend")
    cache_off = _given(argv, "--disable-radix-cache")
    drop: set[str] = set()
    if backend == "k3" and not cache_off:
        drop.add("--disable-overlap-schedule")
    elif not cache_off and strategy is None:
        drop |= {"--mamba-radix-cache-strategy", "--disable-overlap-schedule"}
    elif strategy not in (None, "no_buffer"):
        drop.add("--disable-overlap-schedule")
    return [d for d in CPU_DEFAULTS if d[0] not in drop]


def _check_backend_strategy(argv: list[str]) -> None:
    """k3 tracks its states itself, at request ends and chunk ends, under ``no_buffer``; SGLang's
    ``extra_buffer`` (spare slots the forward snapshots into) is not wired to it yet."""
    backend = _value(argv, "--radix-cache-backend")
    strategy = _value(argv, "--mamba-radix-cache-strategy")
    if backend == "k3" and strategy not in (None, "no_buffer"):
        raise SystemExit(
            f"--radix-cache-backend k3 runs with --mamba-radix-cache-strategy no_buffer (got {strategy}); "
            "use --radix-cache-backend upstream for SGLang's own extra_buffer cache"
        )


def _check_page_size(argv: list[str]) -> None:
    """The page sizes k3 serves nest with the KDA kernel's 64-token state grid (powers of two up
    to 256: ``check_page_size`` says why)."""
    if not _k3_serves(argv):
        return
    value = _value(argv, "--page-size")
    if value is None:
        return
    from sglang_k3.cache.build import check_page_size

    try:
        check_page_size(int(value))
    except ValueError as e:
        raise SystemExit(f"--page-size {value}: {e}") from None


def _speculative_defaults(argv: list[str], cfg: K3Config, cpu: bool) -> tuple[list[str], K3Config]:
    """Speculative decoding with the k3 cache: NGRAM serves, and EAGLE / EAGLE3 with draft
    chains; the rest stops here, before SGLang starts
    (:func:`~sglang_k3.integration.k3_args.check_speculative` says why). On the CPU platform NGRAM
    verifies draft chains: its BFS breadth defaults to 1 (SGLang's is 10). On a GPU the k3 cache
    runs over SGLang's fixed pools with speculation: on an H100 its verify ran 0.56x the cache-off
    server's output tokens/s over the unified buffer and 0.83x over fixed pools
    (benchmarks/GPU_NOTES.md, sixth session); an EAGLE draft model's KV pool is sized from the
    target's fixed pool, so the unified allocator's ids would run past it (on CPU too:
    ``patches/kv_cache_configurator_init_pools`` leaves SGLang's pools with a draft model). On CPU
    an EAGLE draft is a chain of one step a verify unless ``--speculative-num-steps`` says more
    (``--speculative-eagle-topk 1`` and ``--speculative-num-draft-tokens`` steps + 1 set where not
    given), with or without the k3 cache (the CPU verify takes chains; a cache-off server given only
    ``--speculative-num-steps`` stopped in SGLang's own argument check with a ``TypeError``); with
    NGRAM unified memory stays."""
    import dataclasses

    algorithm = _value(argv, "--speculative-algorithm")
    if not algorithm:
        return argv, cfg
    from sglang_k3.integration.k3_args import (
        DRAFT_MODEL_ALGORITHMS,
        EAGLE_DRAFT_TOKENS_FLAG,
        EAGLE_STEPS_FLAG,
        EAGLE_TOPK_FLAG,
        NGRAM_CPU_BREADTH_FLAG,
        check_speculative,
        eagle_chain_steps,
    )

    draft_model = str(algorithm).upper() in DRAFT_MODEL_ALGORITHMS
    # On a GPU SGLang takes the three chain flags together, or none (then it picks them): given
    # the steps alone it stopped with a TypeError, a topk or width without the steps with an
    # AssertionError. With the k3 cache (chains only) the steps decide the other two.
    chain_given = [_value(argv, f) for f in (EAGLE_STEPS_FLAG, EAGLE_TOPK_FLAG, EAGLE_DRAFT_TOKENS_FLAG)]
    gpu_chain = draft_model and not cpu and _k3_serves(argv) and any(v is not None for v in chain_given)
    if draft_model and (cpu or (gpu_chain and chain_given[0] is not None)):
        try:
            steps = eagle_chain_steps(_value(argv, EAGLE_STEPS_FLAG) or "1")
        except ValueError as e:
            raise SystemExit(str(e)) from None
        chain = [(EAGLE_STEPS_FLAG, str(steps)), (EAGLE_TOPK_FLAG, "1"), (EAGLE_DRAFT_TOKENS_FLAG, str(steps + 1))]
        missing = [(f, v) for f, v in chain if _value(argv, f) is None]
        if missing:
            print(
                f"sglang-k3: --speculative-algorithm {algorithm} {'on CPU' if cpu else 'with the k3 cache'}: "
                + " ".join(f"{f} {v}" for f, v in missing)
                + (
                    " (a draft chain; each draft step costs a draft forward on the CPU)"
                    if cpu
                    else " (a draft chain: SGLang needs them beside the steps)"
                ),
                file=sys.stderr,
            )
            argv = argv + [x for fv in missing for x in fv]
    if cpu and str(algorithm).upper() == "NGRAM" and _value(argv, NGRAM_CPU_BREADTH_FLAG) is None:
        print(
            f"sglang-k3: --speculative-algorithm NGRAM on CPU: {NGRAM_CPU_BREADTH_FLAG} 1 (the CPU path "
            "verifies draft chains)",
            file=sys.stderr,
        )
        argv = argv + [NGRAM_CPU_BREADTH_FLAG, "1"]
    if not _k3_serves(argv):  # the CPU path's chains above hold with the cache off too; the rest is the k3 cache's
        return argv, cfg
    try:
        check_speculative(
            algorithm,
            cpu=cpu,
            ngram_breadth=_value(argv, NGRAM_CPU_BREADTH_FLAG),
            eagle_topk=_value(argv, EAGLE_TOPK_FLAG),
            eagle_steps=_value(argv, EAGLE_STEPS_FLAG),
            eagle_draft_tokens=_value(argv, EAGLE_DRAFT_TOKENS_FLAG),
        )
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if gpu_chain and chain_given[0] is None:  # after the refusals above: a topk of 2 is refused as such
        raise SystemExit(
            f"sglang-k3: --speculative-algorithm {algorithm}: {EAGLE_TOPK_FLAG} or {EAGLE_DRAFT_TOKENS_FLAG} "
            f"without {EAGLE_STEPS_FLAG}: give the draft steps too (a chain of n steps is verified as "
            "n + 1 tokens), or none of the three for SGLang's own choice"
        )
    if not cpu and cfg.unified_memory:
        print(
            f"sglang-k3: --speculative-algorithm {algorithm} on a GPU: the k3 cache runs over SGLang's own KV and "
            "state pools (as --k3-no-unified-memory): the verify ran slower over the unified buffer"
            + (", and a draft model's KV pool is sized from SGLang's own" if draft_model else ""),
            file=sys.stderr,
        )
        cfg = dataclasses.replace(cfg, unified_memory=False)
    return argv, cfg


def _check_mooncake_client() -> None:
    """``--k3-mooncake``: the store client loads in every scheduler process; fail here, before
    SGLang starts, with what is missing and how to install it, not in a scheduler's traceback."""
    from sglang_k3.tiers.system_deps import MissingDependency, store_client_class

    try:
        store_client_class("launch_server --k3-mooncake")
    except MissingDependency as e:
        raise SystemExit(f"error: {e}") from None


# Prefill/decode disaggregation (SGLang's --disaggregation-mode), measured on CPU with Mooncake
# over TCP (docs/user_guide.md, "Prefill/decode disaggregation"; SGLang 0.5.23 paths):
# * its KV transfer registers one contiguous region per layer (MLATokenToKVPool.
#   get_contiguous_buf_infos); over k3's unified buffer those regions overlap and Mooncake refused
#   them. The unified pools describe themselves as one region with whole-page and whole-slot
#   entries instead (unified_memory.describe_for_transfer), so a PD server keeps unified memory.
# * a prefill on CPU: disaggregation/prefill.py::_send_kv_chunk takes a pinned-memory, CUDA-event
#   path for Mooncake's host-tensor indices unless this switch sends every CP rank's indices
#   (the plain path; with one CP rank it changes nothing else); and under the overlap scheduler a
#   prefix hit records a CUDA event on the forward stream (maybe_send_cached_prefix_chunk). Both
#   stop the scheduler on a machine without CUDA.
PD_CPU_PREFILL_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"


def _pd_defaults(argv: list[str], cfg: K3Config, cpu: bool) -> tuple[list[str], K3Config]:
    """What a prefill or decode server of a disaggregated deployment needs (reasons above)."""
    mode = _value(argv, "--disaggregation-mode")
    if mode not in ("prefill", "decode"):
        return argv, cfg
    if cpu and mode == "prefill":
        os.environ.setdefault(PD_CPU_PREFILL_ENV, "1")
        if _k3_serves(argv):
            argv = _with_defaults(argv, [("--disable-overlap-schedule", None)])
    return argv, cfg


def build_argv(argv: list[str]) -> tuple[list[str], K3Config]:
    """Split our flags off ``argv`` and return SGLang's argv with our defaults added."""
    ours = argparse.ArgumentParser(add_help=False)
    add_k3_args(ours)
    ns, rest = ours.parse_known_args(argv)
    cfg = from_namespace(ns)

    from sglang_k3.integration.platform_entry import cpu_platform_wanted

    if not _given(rest, "--model-path", "--model"):
        from sglang_k3.model.tiny_build import ENV_HOME, default_model_path

        if cfg.embedded_model_dir:
            os.environ[ENV_HOME] = cfg.embedded_model_dir
        print("sglang-k3: no --model-path given; serving the embedded tiny K3 model", file=sys.stderr)
        # Keep the KDA conv state in fp32 like the rest of this fp32 model (SGLang's default is
        # bf16), so greedy outputs equal the fp32 reference token for token.
        os.environ.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")
        rest = ["--model-path", default_model_path()] + _with_defaults(rest, EMBEDDED_MODEL_DEFAULTS)
    rest = _with_defaults(rest, CACHE_DEFAULTS)
    _check_backend_strategy(rest)
    _check_page_size(rest)
    if cfg.mooncake:
        _check_mooncake_client()
    if _k3_serves(rest):
        rest = _with_defaults(rest, K3_DEFAULTS)
    if _value(rest, "--radix-cache-backend") == "k3":
        # Under the overlap scheduler, process one prefill's results before the next prefill
        # starts (upstream's own switch; it helps the first batch's TTFT): the states the k3
        # cache checkpoints from a prefill are that prefill's, held until its results are
        # processed (sglang_k3/state/export_stash.py). Set it to 0 to overlap them anyway: those
        # prefills then leave no chunk-boundary checkpoints (never a wrong one).
        os.environ.setdefault(CONSECUTIVE_PREFILL_ENV, "1")
    cpu = cfg.cpu_defaults and cpu_platform_wanted()
    rest, cfg = _speculative_defaults(rest, cfg, cpu)
    rest, cfg = _pd_defaults(rest, cfg, cpu)
    if cpu:
        rest = _with_defaults(rest, _cpu_defaults_for(rest))
    return rest, cfg


def print_help() -> None:
    """Print our flags first, under their own heading, then SGLang's (over 2,000 lines): a user
    looking for what sglang-k3 adds finds it at the top. The usage line names the two groups
    instead of listing every flag (argparse's own would run to hundreds of lines)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG, usage=USAGE, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_k3_args(parser)
    # Argument groups print in the order they are made, so SGLang's come after ours.
    ServerArgs.add_cli_args(parser.add_argument_group(SGLANG_HEADING, SGLANG_POINTER))
    for action in parser._actions:
        if "--model-path" in action.option_strings:
            action.required = False
            action.help = "Path to model weights (default: the embedded tiny K3-architecture model)."
    parser.print_help()


def _install_fleet_info() -> None:
    """``GET /k3_fleet_info`` and the session-key middleware on SGLang's HTTP app
    (:mod:`sglang_k3.fleet.instance_info`)."""
    from sglang.srt.entrypoints import http_server

    from sglang_k3.fleet import instance_info
    from sglang_k3.integration.admission import admission_of

    def admission():
        state = http_server.get_global_state()
        return None if state is None else admission_of(state.tokenizer_manager)

    instance_info.install(http_server.app, instance_info.SessionsSeen(), admission)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if _given(argv, "-h", "--help"):
        print_help()
        return
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    sglang_argv, cfg = build_argv(argv)
    cfg.to_env()
    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    _install_fleet_info()
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
