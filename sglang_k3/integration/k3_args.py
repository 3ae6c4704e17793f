"""sglang-k3's own command-line flags (all prefixed ``--k3-``), parsed into a
:class:`~sglang_k3.config.K3Config`.

``launch_server`` parses ours first, removes them from argv and publishes the config to the
scheduler processes (:mod:`sglang_k3.config` says how); ``current()`` reads it back.
"""

from __future__ import annotations

import argparse

from sglang_k3.config import ENV_CONFIG, TIER_WRITE_POLICIES, K3Config, from_env  # noqa: F401  (re-exported)


def add_k3_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group(
        "sglang-k3",
        "Options added by sglang-k3. Every other option is SGLang's own and is passed through.",
    )
    g.add_argument(
        "--k3-embedded-model-dir",
        default=None,
        metavar="DIR",
        help="Where the embedded tiny K3-architecture model is built on first use when no "
        "--model-path is given (default: $SGLANG_K3_HOME or ~/.cache/sglang_k3).",
    )
    g.add_argument(
        "--k3-no-cpu-defaults",
        action="store_true",
        help="On a machine without CUDA, do not add the CPU serving defaults (--device cpu "
        "--attention-backend torch_native --max-total-tokens 8192 --skip-server-warmup "
        "--mamba-radix-cache-strategy no_buffer --max-mamba-cache-size 32 --sleep-on-idle, and "
        "--disable-overlap-schedule for SGLang's own cache under no_buffer or with the cache off; the k3 "
        "cache keeps the overlap scheduler on). Flags given explicitly always win over these defaults.",
    )
    g.add_argument(
        "--k3-no-chunk-checkpoints",
        action="store_true",
        help="k3 cache: do not checkpoint the KDA state at the end of each prefill chunk.",
    )
    g.add_argument(
        "--k3-no-prompt-checkpoints",
        action="store_true",
        help="k3 cache: do not checkpoint the KDA state at the end of each prompt.",
    )
    g.add_argument(
        "--k3-no-generation-checkpoints",
        action="store_true",
        help="k3 cache: do not keep the KDA state at the end of each generation (the turn "
        "boundary the next turn of a conversation matches; donated, not copied).",
    )
    g.add_argument(
        "--k3-no-branch-checkpoints",
        action="store_true",
        help="k3 cache: do not checkpoint at radix branch points (where a new request diverges "
        "from a cached path, found by matching it before its prefill, as Marconi does).",
    )
    g.add_argument(
        "--k3-keep-superseded-checkpoints",
        action="store_true",
        help="k3 cache: when a request finishes, keep its earlier states (chunk ends, prompt end) "
        "next to its generation-end state. By default they leave the tree then, unless they "
        "were hit, sit where cached paths fork, or the request repeated a cached prompt: the "
        "next turn matches the generation end, so one state per turn saves the same prefill "
        "with half the state memory or less. Where the traffic reuses such states, the cache "
        "keeps them anyway (see --k3-no-adaptive-retention).",
    )
    g.add_argument(
        "--k3-no-adaptive-retention",
        action="store_true",
        help="k3 cache: apply the placement rules that let states go (recycling superseded "
        "chunk ends, one state per turn) always. By default the cache learns, per class of "
        "state (chunk end, prompt end, decode interval, earlier turn end), how often such "
        "states are used again, from hits and from ghosts (records of the states it let go "
        "that a later request would have restored from), and keeps a class's states while it "
        "is used again at least as often as the turn-end states are. Linear conversations "
        "rarely come back inside a finished turn, so there the rules hold; traffic that forks "
        "inside earlier prompts (documents shared by many questions) keeps them.",
    )
    g.add_argument(
        "--k3-eager-drops",
        action="store_true",
        help="k3 cache: states those rules let go leave at once. By default, with unified "
        "memory, they stay while the budget has free memory (still matchable) and go first "
        "when it is short, so the rest of the cache is the same and a rule that guessed wrong "
        "costs nothing while memory is free. Fixed pools always drop at once.",
    )
    g.add_argument(
        "--k3-decode-checkpoint-interval",
        type=int,
        default=4096,
        metavar="N",
        help="k3 cache: while a request decodes, checkpoint its state every N tokens of its "
        "sequence (recyclable once superseded; 0: off; default 4096). The end of each "
        "generation is kept anyway.",
    )
    g.add_argument(
        "--k3-checkpoint-budget",
        type=int,
        default=8,
        metavar="N",
        help="k3 cache: at most N checkpoints kept on one root-to-leaf path; superseded chunk "
        "checkpoints are recycled first (0: no cap; default 8).",
    )
    g.add_argument(
        "--k3-checkpoint-dtype",
        choices=["int8", "bf16", "fp32"],
        default="int8",
        help="k3 cache: format of parked KDA checkpoints (default int8: per-(layer, head, k) fp32 "
        "scales over V; conv state kept in its native dtype). fp32 keeps checkpoints in SGLang's "
        "mamba pool, bit-exact, with zero-copy donation of finished requests' states. Active "
        "states always stay full precision.",
    )
    g.add_argument(
        "--k3-checkpoint-slots",
        type=int,
        default=64,
        metavar="N",
        help="Only with --k3-no-unified-memory: size of the int8/bf16 checkpoint pool in "
        "checkpoints (default 64; fp32 checkpoints share --max-mamba-cache-size instead, unless a "
        "lower tier is on: then they have a pool of this many fp32 slots). Under unified memory the "
        "number of checkpoints is decided by their value, not by a count.",
    )
    g.add_argument(
        "--k3-no-unified-memory",
        action="store_true",
        help="k3 cache: keep SGLang's fixed pools (a KV pool, a state pool sized by "
        "--max-mamba-cache-size / --mamba-full-memory-ratio) and a checkpoint pool of "
        "--k3-checkpoint-slots. By default MLA KV, active KDA states and checkpoints share one "
        "byte budget, the bytes SGLang sizes for its KV and state pools (--mem-fraction-static, "
        "--max-total-tokens, --max-mamba-cache-size), and the least valuable KV or checkpoint "
        "gives way when either runs short.",
    )
    g.add_argument(
        "--k3-min-kv-tokens",
        type=int,
        default=0,
        metavar="N",
        help="Unified memory: checkpoints never take memory MLA KV needs to hold N tokens (a floor; default 0).",
    )
    g.add_argument(
        "--k3-min-checkpoints",
        type=int,
        default=0,
        metavar="N",
        help="Unified memory: KV and state-slot pressure never evicts checkpoints below N (a floor; default 0).",
    )
    g.add_argument(
        "--k3-max-checkpoints",
        type=int,
        default=0,
        metavar="N",
        help="Unified memory: at most N checkpoints live at once (a cap; default 0: none).",
    )
    g.add_argument(
        "--k3-eviction-alpha",
        type=float,
        default=1.0,
        metavar="A",
        help="k3 cache: eviction ranks KV and checkpoints by recency + A x prefill FLOPs saved per "
        "byte, a checkpoint's saving weighted by 1 + log2(1 + its hits) (the saving per byte on a "
        "log scale; both terms min-max normalised; ties go to the older; 0: pure LRU; default 1). "
        "A state kept only for a regeneration of its prompt (superseded) is priced at 0. In the "
        "trace replay 1 beats 0 at every budget on the conversation and fork-heavy traces, and on "
        "the chat mix but for a 0.0003 loss at 20 GiB; 2 loses badly (docs/results.md, trace replay).",
    )
    g.add_argument(
        "--k3-host-tier-gib",
        type=float,
        default=0.0,
        metavar="GIB",
        help="k3 cache: keep boundaries evicted from the device (a checkpoint, INT8 as stored, with "
        "the MLA KV of its prefix) in a host-memory tier of GIB GiB, least recently used out, and "
        "bring the deepest one a new request can use back before its prefill (default 0: off).",
    )
    g.add_argument(
        "--k3-tier-write-policy",
        choices=TIER_WRITE_POLICIES,
        default="write_back",
        help="k3 cache: when a boundary is copied to the lower tiers, with SGLang HiCache's names: "
        "write_back (default) when the device evicts it; write_through as soon as it is stored; "
        "write_through_selective at its first hit. Each also saves at eviction what is not below yet.",
    )
    g.add_argument(
        "--k3-tier-park-interval",
        type=int,
        default=None,
        metavar="N",
        help="k3 cache, with a lower tier: while a prompt is prefilled, also save its state every N "
        "tokens (a multiple of 64) straight to the lower tiers, not to the device, so a later request "
        "that forks inside this prompt restores close to its fork. Default 4096 when a lower tier is "
        "on (about 3 KB of int8 state per prompt token at Kimi-Linear-48B sizes, against 8 KB of MLA "
        "KV; in the trace replay it takes every suite member to 0.97-1.00 of the oracle, against "
        "0.85-1.00 without), ignored without one; 0: off.",
    )
    g.add_argument(
        "--k3-tier-write-queue-mib",
        type=int,
        default=K3Config.tier_write_queue_mib,
        metavar="MIB",
        help="k3 cache, with a lower tier: writes to the tiers leave the scheduler's thread. A save "
        "copies the boundary's bytes off the device at once; one writer thread checksums them and "
        "puts them into the host tier and Mooncake, and a boundary is found below only once its "
        "write landed. At most MIB of writes are in flight (host memory on top of --k3-host-tier-gib): "
        "a save beyond that is dropped and counted (tier_save_dropped), never waited for. Default "
        "%(default)s; 0: every save writes before it returns, on the scheduler's thread.",
    )
    g.add_argument(
        "--k3-mooncake",
        action="store_true",
        help="k3 cache: add a Mooncake store as the L3 tier, below the host tier (or alone), shared "
        "with every instance on the same mooncake_master: an instance restores prefixes another "
        "one computed. Configured as SGLang's HiCache Mooncake backend is: the JSON file at "
        "$SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, or MOONCAKE_MASTER (host:port), MOONCAKE_PROTOCOL "
        "(tcp without RDMA), MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_GLOBAL_SEGMENT_SIZE (this "
        "instance's share of the pool, e.g. 4gb; 0 with a standalone store client), "
        "MOONCAKE_LOCAL_HOSTNAME, MOONCAKE_DEVICE. scripts/start_mooncake_master.py starts a master.",
    )
    g.add_argument(
        "--k3-admission-thresholds",
        type=int,
        nargs="+",
        default=[],
        metavar="TOKENS",
        help="Admission budgets per request class (any cache backend): prompt lengths that split "
        "requests into classes, ascending; e.g. 2048 makes two classes, <2048 and >=2048 tokens. "
        "Each class may hold at most its share of --k3-admission-capacity-tokens prompt tokens in "
        "flight (admitted and not yet past prefill); the rest wait in this server, first come first "
        "served within their class, so a burst of long prompts cannot starve short ones. Requests of "
        "one /generate batch are not budgeted (default: none, budgets off).",
    )
    g.add_argument(
        "--k3-admission-shares",
        type=float,
        nargs="+",
        default=[],
        metavar="SHARE",
        help="With --k3-admission-thresholds: each class's share of the capacity, in (0, 1], one per "
        "class, shortest first (default: 1.0 for the shortest class, 0.5 for each longer one). A "
        "single prompt larger than its class's budget is admitted alone.",
    )
    g.add_argument(
        "--k3-admission-capacity-tokens",
        type=int,
        default=0,
        metavar="TOKENS",
        help="With --k3-admission-thresholds: the instance's prefill capacity in prompt tokens that "
        "the shares divide (default 0: SGLang's --chunked-prefill-size, or --max-prefill-tokens when "
        "chunking is off).",
    )
    return g


def from_namespace(ns: argparse.Namespace) -> K3Config:
    if ns.k3_checkpoint_budget < 0:
        raise SystemExit("--k3-checkpoint-budget must be >= 0")
    if ns.k3_decode_checkpoint_interval < 0:
        raise SystemExit("--k3-decode-checkpoint-interval must be >= 0")
    if ns.k3_checkpoint_slots < 1:
        raise SystemExit("--k3-checkpoint-slots must be >= 1")
    for flag in ("min_kv_tokens", "min_checkpoints", "max_checkpoints"):
        if getattr(ns, "k3_" + flag) < 0:
            raise SystemExit(f"--k3-{flag.replace('_', '-')} must be >= 0")
    if not (0 <= ns.k3_eviction_alpha < float("inf")):
        raise SystemExit("--k3-eviction-alpha must be a finite number >= 0")
    park = ns.k3_tier_park_interval
    if park is not None and (park < 0 or park % 64):
        raise SystemExit("--k3-tier-park-interval must be a multiple of 64 (0: off)")
    if park and not (ns.k3_host_tier_gib > 0 or ns.k3_mooncake):
        raise SystemExit("--k3-tier-park-interval needs a lower tier (--k3-host-tier-gib or --k3-mooncake)")
    if ns.k3_tier_write_queue_mib < 0:
        raise SystemExit("--k3-tier-write-queue-mib must be >= 0 (0: synchronous writes)")
    if not (0 <= ns.k3_host_tier_gib < float("inf")):
        raise SystemExit("--k3-host-tier-gib must be a finite number >= 0")
    if ns.k3_max_checkpoints and ns.k3_min_checkpoints > ns.k3_max_checkpoints:
        raise SystemExit("--k3-min-checkpoints is above --k3-max-checkpoints")
    if (ns.k3_admission_shares or ns.k3_admission_capacity_tokens) and not ns.k3_admission_thresholds:
        raise SystemExit("--k3-admission-shares and --k3-admission-capacity-tokens need --k3-admission-thresholds")
    if ns.k3_admission_capacity_tokens < 0:
        raise SystemExit("--k3-admission-capacity-tokens must be >= 0 (0: the server's prefill chunk)")
    if ns.k3_admission_thresholds:
        from sglang_k3.fleet.admission import policy_from_config

        try:
            policy_from_config(ns_admission(ns), 1)
        except ValueError as e:
            raise SystemExit(f"--k3-admission-*: {e}") from None
    return K3Config(
        embedded_model_dir=ns.k3_embedded_model_dir,
        cpu_defaults=not ns.k3_no_cpu_defaults,
        checkpoint_chunk_end=not ns.k3_no_chunk_checkpoints,
        checkpoint_prompt_end=not ns.k3_no_prompt_checkpoints,
        checkpoint_generation_end=not ns.k3_no_generation_checkpoints,
        checkpoint_branch_points=not ns.k3_no_branch_checkpoints,
        checkpoint_keep_superseded=ns.k3_keep_superseded_checkpoints,
        adaptive_retention=not ns.k3_no_adaptive_retention,
        lazy_drops=not ns.k3_eager_drops,
        checkpoint_budget=ns.k3_checkpoint_budget,
        checkpoint_dtype=ns.k3_checkpoint_dtype,
        checkpoint_slots=ns.k3_checkpoint_slots,
        decode_checkpoint_interval=ns.k3_decode_checkpoint_interval,
        unified_memory=not ns.k3_no_unified_memory,
        min_kv_tokens=ns.k3_min_kv_tokens,
        min_checkpoints=ns.k3_min_checkpoints,
        max_checkpoints=ns.k3_max_checkpoints,
        eviction_alpha=ns.k3_eviction_alpha,
        host_tier_gib=ns.k3_host_tier_gib,
        tier_write_policy=ns.k3_tier_write_policy,
        mooncake=ns.k3_mooncake,
        tier_park_interval=K3Config.tier_park_interval if park is None else park,
        tier_write_queue_mib=ns.k3_tier_write_queue_mib,
        admission_thresholds=tuple(ns.k3_admission_thresholds),
        admission_shares=tuple(ns.k3_admission_shares),
        admission_capacity_tokens=ns.k3_admission_capacity_tokens,
    )


def ns_admission(ns: argparse.Namespace) -> K3Config:
    """Only the admission fields of ``ns``, as a config (to check them before the rest)."""
    return K3Config(
        admission_thresholds=tuple(ns.k3_admission_thresholds),
        admission_shares=tuple(ns.k3_admission_shares),
        admission_capacity_tokens=max(0, ns.k3_admission_capacity_tokens),
    )


def current() -> K3Config:
    """The config ``launch_server`` published for this process tree (defaults when none)."""
    return from_env()


NGRAM_CPU_BREADTH_FLAG = "--speculative-ngram-max-bfs-breadth"


EAGLE_TOPK_FLAG = "--speculative-eagle-topk"
EAGLE_STEPS_FLAG = "--speculative-num-steps"
EAGLE_DRAFT_TOKENS_FLAG = "--speculative-num-draft-tokens"
DRAFT_MODEL_ALGORITHMS = ("EAGLE", "EAGLE3")  # served with a draft model (sglang_k3.model.tiny_draft builds one)


def eagle_chain_steps(value) -> int:
    """``--speculative-num-steps`` as a whole number of draft steps a verify, 1 or more (the
    chain's verify width, steps + 1, is derived from it); ValueError with the reason otherwise."""
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{EAGLE_STEPS_FLAG} {value}: the draft steps a verify must be a whole number, 1 or more")
    return int(text)


def check_speculative(
    algorithm, *, cpu: bool = False, ngram_breadth=None, eagle_topk=None, eagle_steps=None, eagle_draft_tokens=None
) -> None:
    """Which speculative decoding the k3 cache serves with, refused with the reasons otherwise
    (read in SGLang 0.5.23; issue #34), before it can fail inside a scheduler. Called by
    ``launch_server`` before SGLang starts and by the k3 cache's factory (any other entry point).

    * **NGRAM** serves (no draft model: drafts come from n-grams of the request and earlier ones).
      The k3 cache keeps its hits: a verify commits the state after the accepted tokens only,
      and the decode-interval states are placed when a verify crosses a multiple of the interval.
      On the CPU platform the verify runs on torch ops (``kernels/spec``, ``patches/spec_*``,
      ``patches/torch_native_target_verify``) for draft chains only: ``ngram_breadth`` must be 1
      (``launch_server`` sets it), and ``patches/ngram_chain_drafts`` makes each draft a chain.
    * **EAGLE / EAGLE3** (a draft model: ``--speculative-draft-model-path``) serve with draft
      chains (``eagle_topk`` 1, or unset: SGLang then picks 1 for this model), over SGLang's fixed
      KV and state pools (the draft's KV pool is sized from the target's and shares its
      allocator: ``patches/kv_cache_configurator_init_pools`` leaves unified memory off).
      ``patches/kimi_linear_eagle`` gives ``KimiLinearForCausalLM`` the two methods the draft asks
      of its target. Draft trees (topk > 1) are not tested with the k3 cache (SGLang's FlashInfer
      KDA verify refuses them). A chain of ``eagle_steps`` drafts is verified as
      ``eagle_steps + 1`` tokens (``eagle_draft_tokens``; SGLang asserts it in the scheduler). On
      the CPU platform the draft's ops run in torch (``kernels/spec``, ``patches/spec_*``), its
      attention on SGLang's torch-native backend, one per draft step
      (``patches/spec_draft_backend_torch_native``).
    * **NEXTN** needs an MTP/NextN layer in the target: ``KimiLinearForCausalLM`` has none.
    * **STANDALONE** (a small draft model of the same vocabulary) and the rest (DFLASH, UNO,
      DSPARK, FROZEN_KV_MTP) are not tested with the k3 cache; on the CPU platform SGLang refuses
      them (its out-of-tree check, or CUDA-only workers)."""
    if not algorithm:
        return
    name = str(algorithm).upper()
    if name == "NGRAM":
        if cpu and ngram_breadth is not None and int(ngram_breadth) != 1:
            raise ValueError(
                f"--speculative-algorithm NGRAM {NGRAM_CPU_BREADTH_FLAG} {ngram_breadth}: on CPU the k3 cache "
                "verifies draft chains only (torch ops; a draft tree's attention mask and per-branch KDA states "
                f"have no CPU path). Use {NGRAM_CPU_BREADTH_FLAG} 1 (sglang_k3.launch_server's default on CPU)"
            )
        return
    if name in DRAFT_MODEL_ALGORITHMS:
        if eagle_topk is not None and int(eagle_topk) != 1:
            raise ValueError(
                f"--speculative-algorithm {algorithm} {EAGLE_TOPK_FLAG} {eagle_topk}: the k3 cache serves EAGLE "
                f"with draft chains only ({EAGLE_TOPK_FLAG} 1): draft trees are not tested with it, and SGLang's "
                "FlashInfer KDA verify refuses them"
            )
        chain_width = None if eagle_steps is None else eagle_chain_steps(eagle_steps) + 1
        if chain_width is not None and eagle_draft_tokens is not None and int(eagle_draft_tokens) != chain_width:
            raise ValueError(
                f"--speculative-algorithm {algorithm} {EAGLE_STEPS_FLAG} {eagle_steps} {EAGLE_DRAFT_TOKENS_FLAG} "
                f"{eagle_draft_tokens}: a draft chain of {eagle_steps} tokens is verified as {chain_width} "
                f"(the last verified token and the drafts): use {EAGLE_DRAFT_TOKENS_FLAG} {chain_width}"
            )
        return
    why = (
        "KimiLinearForCausalLM has no MTP/NextN layer to draft with (EAGLE or EAGLE3 with a draft model serve: "
        "--speculative-draft-model-path)"
        if name == "NEXTN"
        else "it is not tested with the k3 cache (and on CPU SGLang refuses it)"
    )
    raise ValueError(
        f"--speculative-algorithm {algorithm}: the k3 cache does not serve with it: {why}. NGRAM serves "
        "(--speculative-algorithm NGRAM: drafts from n-grams, no draft model), and EAGLE / EAGLE3 with a draft "
        "model (--speculative-draft-model-path)"
    )
