#!/usr/bin/env bash
# The project's GPU serving runs on the lent H200, one device call per phase:
#
#   run(command="bash benchmarks/gpu_serving.sh PHASE", carry=[".whl-serving"])
#
# (fetch the wheel set here first: bash ../shared/tools/gpu_serving/fetch_wheels.sh). Each call
# installs SGLang 0.5.23's GPU wheel set and this project into /tmp/site (about 5 s), builds the
# bf16 model with Kimi-Linear head sizes (kv_lora_rank 512, head dim 128), runs PHASE and leaves
# its results and server logs in $OUT/PHASE.tar.gz. Servers are started and stopped by the Python
# harnesses (each records its servers' pids in its log folder); nothing is left running.
#
# Phases:
#   all           differential (fp32, int8, upstream; 40 requests) and ab (defaults only) at reduced
#                 sizes, in one call (about 7 minutes): what one device session affords
#   differential  benchmarks.noise_differential: k3 fp32, k3 int8 and upstream against cache-off,
#                 judged against the bf16 noise floor of the same run, plus a deliberately corrupted
#                 int8 restore (--stagger: the reference first, so the rest find its Triton kernels).
#                 Its model has long-memory KDA heads (ND_DECAY, below); ND_EXTRA adds server flags
#                 (ND_EXTRA="--page-size 64").
#   ab            benchmarks.live_ab with three servers (k3 at its defaults, upstream at its real
#                 default: extra_buffer, overlap on, its Python tree core; cache off): multi-turn
#                 conversations of a few thousand tokens that branch at their third turn, and the
#                 trace slice; each cache's CPU time per scheduling step (--time-cache); then the
#                 multi-turn under a small, equal memory budget with k3's host tier on (2 GiB).
#                 AB_EXTRA adds flags to every server (AB_EXTRA="--page-size 64"; then set
#                 AB_K3_PRESSURE_ARGS="" too: the host tier needs page 1).
#   det           the noise differential again (fp32, int8) with every server under SGLang's
#                 --enable-deterministic-inference: does it run with these backends, does the floor shrink?
#   probe         benchmarks.gpu_probe: which of several server configurations serve a small batched
#                 multi-turn workload, each alone, with CUDA_LAUNCH_BLOCKING=1 (PROBE_CONFIGS).
#   spec          benchmarks.spec_ab (speculative decoding, issue 34; NGRAM, or SPEC_ALGO=EAGLE3|EAGLE with a
#                 random draft model built here): k3 with and without it,
#                 upstream with it (extra_buffer), cache off with it; greedy mismatches against k3
#                 are informational in bf16 (the noise floor: two cache-off servers disagree too).
#   profile       the ab phase's pressure run with k3 and upstream only, each scheduler under cProfile
#                 (live_ab --profile-cache): where the time per scheduling step goes.
#   tiermoves     benchmarks/gpu_tier_moves.py (no server): the tier's saves and loads against a plain
#                 pinned copy, the writer thread's section included (the host-link fraction of issue
#                 32). It needs the installed project (setup.py maps sglang_k3.kernels in), which is
#                 why it runs here and not from the source tree (GPU_NOTES.md, fifth session).
# Cold starts: on a fresh machine the differential's reference server took 195 s (Triton compiles)
# and the candidates, started after it, 2 minutes more: keep ND_TIMEOUT above about 450.
# Each phase keeps its own harness timeouts under the device's 600 s per call (ND_TIMEOUT for the
# differentials), so that the archive is always written.
set -u
PHASE=${1:?usage: bash benchmarks/gpu_serving.sh all|differential|ab|det|probe|spec|profile|tiermoves}
OUT=${OUT:?OUT must name the output folder (the device sets it)}
# results gather here and come back as one archive, $OUT/PHASE.tar.gz (the device returns 8 files)
RES=/tmp/res/$PHASE
mkdir -p "$RES"
trap 'tar czf "$OUT/$PHASE.tar.gz" -C /tmp/res "$PHASE"' EXIT
exec > >(tee "$RES/driver.log") 2>&1

if [ ! -d .whl-serving ]; then
  echo "error: .whl-serving/ is missing: run bash ../shared/tools/gpu_serving/fetch_wheels.sh here and carry it"
  exit 1
fi
# the command prefix of ../shared/tools/gpu_serving/README.md
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl-serving/*.whl \
  && cp .whl-serving/cutedsl_dual_gemm_shim.py /tmp/site/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py \
  && { PYTHONPATH=/tmp/site python3 -c 'import flash_mla' 2>/dev/null \
       || cp benchmarks/gpu_shims/flashmla_backend_absent.py /tmp/site/sglang/srt/layers/attention/flashmla_backend.py; } \
  && export PYTHONPATH=/tmp/site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
# upstream's Rust tree core is built against torch 2.14's ABI and segfaults on this torch 2.11
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# Run from outside the checkout: there `python -m sglang_k3...` would import the source tree's
# sglang_k3 first, which has no sglang_k3.patches (setup.py maps patches/ into it on install).
# The installed project comes first; the benchmarks come from the checkout.
REPO=$(pwd)
export PYTHONPATH=/tmp/site:$REPO
mkdir -p /tmp/run && cd /tmp/run || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv | tee "$RES/gpu.csv"

MODEL=/tmp/k3-gpu-bf16
if [ ! -f $MODEL/config.json ]; then
  python3 $REPO/scripts/make_tiny_k3.py --out $MODEL --torch-dtype bfloat16 --hidden-size 1024 --kda-heads 8 \
    --kda-head-dim 128 --mla-heads 8 --kv-lora-rank 512 --qk-nope-head-dim 128 --qk-rope-head-dim 64 \
    --v-head-dim 128 --max-position-embeddings 65536 || exit 1
fi
cp $MODEL/config.json "$RES/model_config.json"
# The differentials' model: the same dimensions, with long-memory KDA heads (decay rates exp(A_log)
# drawn from ND_DECAY, default [0.002, 0.5) against the default [1, 16)). With the default decay a
# state is forgotten within a few tokens, so a request's output barely depends on the state it
# restored (negating it moved the first-token logprob by 0.12 on CPU, inside the bf16 floor here):
# a differential could not tell a right restore from a wrong one (GPU_NOTES.md, second session).
ND_DECAY=${ND_DECAY:-0.002,0.5}
ND_MODEL=/tmp/k3-gpu-bf16-decay-${ND_DECAY/,/-}
if [ ! -f $ND_MODEL/config.json ]; then
  python3 $REPO/scripts/make_tiny_k3.py --out $ND_MODEL --torch-dtype bfloat16 --hidden-size 1024 --kda-heads 8 \
    --kda-head-dim 128 --mla-heads 8 --kv-lora-rank 512 --qk-nope-head-dim 128 --qk-rope-head-dim 64 \
    --v-head-dim 128 --max-position-embeddings 65536 --kda-decay-min ${ND_DECAY%,*} --kda-decay-max ${ND_DECAY#*,} || exit 1
fi
# the trace slice's source: ../shared does not travel; carry the first 3,000 requests as .gpu-data
# (mkdir -p .gpu-data && head -3000 ../shared/data/mooncake_conversation_trace.jsonl > .gpu-data/...)
TRACE=$REPO/.gpu-data/mooncake_conversation_trace.jsonl
# The GPU set-up every server shares: bf16 (sglang-kernel's rmsnorm has no fp32 kernel), the triton
# attention backend (no FA3/FlashMLA/flashinfer in the wheel set), a slice of the 141 GB each so
# that all of a phase's servers fit at once.
KERNELS="--dtype bfloat16 --attention-backend triton --sampling-backend pytorch"

# SGLang's idle pool check reports instead of stopping a server, so that one finding does not end
# a whole device call; its reports are counted per server log at the end (idle_leak_reports.txt,
# 0 expected). It found extra_buffer's ping-pong slots left allocated under k3 (now refused).
export SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0
# The A/B phases (ab, profile) answer a warm pass first (live_ab --warm-pass: the synthetic workloads
# once with other prompts; AB_WARM=0 drops it):
# a fresh GPU server compiles and first-launches its Triton kernels there, not in the measured
# pass (GPU_NOTES.md, ninth session).
WARM=$([ "${AB_WARM:-1}" = 1 ] && echo --warm-pass)

case $PHASE in
all)
  # one call for both, at reduced sizes (a device session has 30 minutes)
  mkdir -p /tmp/inner
  (cd "$REPO" && ND_REQUESTS=40 ND_CANDIDATES=fp32,int8,upstream ND_TIMEOUT=230 OUT=/tmp/inner \
    bash benchmarks/gpu_serving.sh differential)
  (cd "$REPO" && AB_CONVERSATIONS=6 AB_TRACE_REQUESTS=24 AB_TIMEOUT=190 AB_NO_PRESSURE=1 OUT=/tmp/inner \
    bash benchmarks/gpu_serving.sh ab)
  mv /tmp/res/differential /tmp/res/ab "$RES"/
  ;;
differential)
  COMMON="--model-path $ND_MODEL $KERNELS --mem-fraction-static 0.1 --max-total-tokens 65536 --max-mamba-cache-size 64 --max-running-requests 16"
  timeout ${ND_TIMEOUT:-360} python3 -m benchmarks.noise_differential --stagger --server-args "$COMMON ${ND_EXTRA:-}" --candidates ${ND_CANDIDATES:-fp32,int8,bf16,upstream} \
    --corrupt int8 --requests ${ND_REQUESTS:-64} --max-new-tokens 16 --system-len 512,2048 --user-len 16,256 --batch-size 8 \
    --out "$RES/default" --log-dir "$RES/logs" --quiet
  echo "noise_differential exit $?"
  pkill -f sglang_k3.launch_server; sleep 2  # a killed harness stops its servers; be sure
  ;;
ab)
  # AB_EXTRA: flags for all three servers (e.g. "--page-size 64"); AB_K3_PRESSURE_ARGS: the k3
  # server's extra flags in the pressure run (default its host tier, which needs page 1)
  # AB_POOLS caps each server's pools: SGLang's memory check counts what the other servers on
  # the card already hold, and on an 80 GB H100 three servers at 0.12 each left the last one to
  # start a negative state-pool size (GPU_NOTES.md, eighth session); the pressure run sets its own
  COMMON="$KERNELS --mem-fraction-static 0.12 --max-running-requests 16 ${AB_POOLS---max-total-tokens 262144 --max-mamba-cache-size 128} ${AB_EXTRA:-}"
  # The workloads: gsp (groups of prompts over shared system prompts; SGLang's bench_serving
  # imports `datasets`, which the GPU wheel set lacks, so live_ab sends them with its own client,
  # --gsp-driver auto), multiturn (conversations that branch at their third turn) and the trace
  # slice. AB_WORKLOADS picks (default gsp,multiturn,trace).
  # Sizes: AB_CONVERSATIONS, AB_TRACE_REQUESTS, AB_TIMEOUT; AB_NO_PRESSURE=1 skips the pressure run,
  # AB_NO_DEFAULT=1 the default one; AB_PRESSURE_WORKLOADS picks the pressure run's (default multiturn),
  # AB_GSP replaces the gsp shape (groups, lengths, concurrency);
  # AB_PROFILE=1 adds --profile-cache (cProfile tables of the scheduler beside its timing files;
  # the cache times of that run are then not the cache's). AB_WARM=0 drops --warm-pass (above).
  # AB_CACHES orders the default run's servers (default k3,upstream,off): live_ab measures them in
  # that order on its first workload and reversed on the next, so with one workload the first
  # named is always measured first (AB_CACHES=upstream,k3,off turns that round).
  GSP=${AB_GSP:-"--gsp-groups 4 --gsp-prompts-per-group 6 --gsp-system-len 2048 --gsp-question-len 128 --gsp-output-len 32 --gsp-concurrency 8"}
  MT="--mt-turns 5 --mt-branches 2 --mt-fork-at 2 --mt-first-len 1024 --mt-user-len 256 --mt-reply-len 32"
  TRACE_ARGS="--trace $TRACE --trace-requests ${AB_TRACE_REQUESTS:-48} --trace-window 3000 --trace-scale 4 --trace-max-output 32 --trace-concurrency 8"
  if [ -z "${AB_NO_DEFAULT:-}" ]; then  # AB_NO_DEFAULT=1: the pressure run only
    timeout ${AB_TIMEOUT:-270} python3 -m benchmarks.live_ab --model-path $MODEL --caches ${AB_CACHES:-k3,upstream,off} \
      --greedy-informational --time-cache ${AB_PROFILE:+--profile-cache} $WARM --extra-server-args "$COMMON" --workloads ${AB_WORKLOADS:-gsp,multiturn,trace} \
      $GSP $MT --mt-conversations ${AB_CONVERSATIONS:-8} --mt-system-len 1024 \
      $TRACE_ARGS --out "$RES/default" --log-dir "$RES/logs" --quiet
    echo "live_ab exit $?"
    pkill -f sglang_k3.launch_server; sleep 2
  fi
  if [ -z "${AB_NO_PRESSURE:-}" ]; then
    # memory pressure: the same SGLang sizing flags for all three (k3's unified budget and
    # upstream's KV + state pools hold the same bytes), well under what the prefixes need
    timeout ${AB_PRESSURE_TIMEOUT:-200} python3 -m benchmarks.live_ab --model-path $MODEL --caches k3,upstream,off \
      --greedy-informational --time-cache ${AB_PROFILE:+--profile-cache} $WARM --extra-server-args "$COMMON --max-total-tokens 24576 --max-mamba-cache-size 24" \
      --k3-server-args "${AB_K3_PRESSURE_ARGS---k3-host-tier-gib 2}" --workloads ${AB_PRESSURE_WORKLOADS:-multiturn} $GSP $MT --mt-conversations 12 --mt-system-len 512 \
      $TRACE_ARGS --out "$RES/pressure" --log-dir "$RES/logs_pressure" --quiet
    echo "live_ab (pressure) exit $?"
    pkill -f sglang_k3.launch_server; sleep 2
  fi
  ;;
det)
  # SGLang's deterministic-inference mode: does it run with these backends, and does the floor shrink?
  COMMON="$KERNELS --mem-fraction-static 0.1 --max-total-tokens 65536 --max-mamba-cache-size 64 --max-running-requests 16"
  timeout ${ND_TIMEOUT:-420} python3 -m benchmarks.noise_differential --stagger \
    --server-args "--model-path $ND_MODEL $COMMON --enable-deterministic-inference" \
    --candidates fp32,int8 --corrupt fp32 --requests ${ND_REQUESTS:-48} --max-new-tokens 16 --system-len 512,2048 \
    --user-len 16,256 --batch-size 8 --out "$RES/deterministic" --log-dir "$RES/logs" --quiet
  echo "noise_differential --enable-deterministic-inference exit $?"
  pkill -f sglang_k3.launch_server; sleep 2
  ;;
probe)
  # which configurations serve: each started alone, a batch of 2k-token first turns and a second
  # turn each (benchmarks.gpu_probe); PROBE_CONFIGS overrides the list (NAME=ARGS;NAME=ARGS...)
  COMMON="--model-path $MODEL $KERNELS --max-running-requests 16"
  CONFIGS=${PROBE_CONFIGS:-"ab_default=--mem-fraction-static 0.12;fixed_pools=--mem-fraction-static 0.12 --k3-no-unified-memory;tokens_64k=--mem-fraction-static 0.12 --max-total-tokens 65536;states_64=--mem-fraction-static 0.12 --max-mamba-cache-size 64;differential=--mem-fraction-static 0.1 --max-total-tokens 65536 --max-mamba-cache-size 64"}
  PARGS=()
  IFS=';' read -ra PARTS <<< "$CONFIGS"
  for c in "${PARTS[@]}"; do PARGS+=(--config "$c" --env "${c%%=*}:CUDA_LAUNCH_BLOCKING=1"); done
  timeout ${PROBE_TIMEOUT:-480} python3 -m benchmarks.gpu_probe --server-args "$COMMON" "${PARGS[@]}" --out "$RES/logs"
  echo "gpu_probe exit $?"
  pkill -f sglang_k3.launch_server; sleep 2
  ;;
spec)
  # SPEC_ARGS: the speculative servers' flags (default spec_ab's: NGRAM, 4 drafts, one chain).
  # SPEC_ONLY: a subset of spec_ab's servers, in its order (k3_spec,k3,upstream_spec,off_spec).
  # SPEC_ALGO=EAGLE3 or EAGLE (default NGRAM): build a random draft for $MODEL (sglang_k3.model.tiny_draft:
  # one Llama layer, bf16 like the target) and, unless SPEC_ARGS is given, pass it with draft chains
  # (3 steps, topk 1, 4 draft tokens) to every speculative server (k3, upstream, cache off).
  COMMON="--model-path $MODEL $KERNELS --mem-fraction-static 0.1 --max-running-requests 16"
  SPEC_ALGO=${SPEC_ALGO:-NGRAM}
  if [ "$SPEC_ALGO" != NGRAM ]; then
    KIND=$(echo "$SPEC_ALGO" | tr A-Z a-z)
    DRAFT=$MODEL-draft-$KIND
    python3 -m sglang_k3.model.tiny_draft --target $MODEL --out $DRAFT --kind $KIND || exit 1
    cp $DRAFT/config.json "$RES/draft_config.json"
    SPEC_ARGS=${SPEC_ARGS:-"--speculative-algorithm $SPEC_ALGO --speculative-draft-model-path $DRAFT --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"}
  fi
  timeout ${SPEC_TIMEOUT:-480} python3 -m benchmarks.spec_ab --server-args "$COMMON" \
    ${SPEC_ARGS:+--spec-args "$SPEC_ARGS"} ${SPEC_ONLY:+--only $SPEC_ONLY} --conversations 4 --turns 3 --system-len 1024 --first-len 512 --user-len 128 \
    --repeat-prompts 4 --repeat-len 1024 \
    --out "$RES/spec_ab" --log-dir "$RES/logs" --quiet
  echo "spec_ab exit $?"
  pkill -f sglang_k3.launch_server; sleep 2
  ;;
profile)
  # where the time per step goes on the GPU: the ab phase's pressure run, k3 and upstream only,
  # each scheduler under cProfile (live_ab --profile-cache; its times are inflated, its tables are
  # the point: LOG_DIR/cache_timing_*/scheduler_*_profile.txt and .prof)
  COMMON="$KERNELS --mem-fraction-static 0.12 --max-running-requests 16 --max-total-tokens 24576 --max-mamba-cache-size 24 ${AB_EXTRA:-}"
  GSP=${AB_GSP:-"--gsp-groups 4 --gsp-prompts-per-group 6 --gsp-system-len 2048 --gsp-question-len 128 --gsp-output-len 32 --gsp-concurrency 8"}
  MT="--mt-turns 5 --mt-branches 2 --mt-fork-at 2 --mt-first-len 1024 --mt-user-len 256 --mt-reply-len 32"
  timeout ${PROFILE_TIMEOUT:-330} python3 -m benchmarks.live_ab --model-path $MODEL --caches k3,upstream \
    --greedy-informational --time-cache --profile-cache $WARM --extra-server-args "$COMMON" \
    --k3-server-args "${AB_K3_PRESSURE_ARGS---k3-host-tier-gib 2}" --workloads ${AB_PRESSURE_WORKLOADS:-multiturn} $GSP $MT --mt-conversations 12 \
    --mt-system-len 512 --out "$RES/pressure" --log-dir "$RES/logs" --quiet
  echo "live_ab (profiled pressure) exit $?"
  pkill -f sglang_k3.launch_server; sleep 2
  ;;
tiermoves)
  timeout ${GTM_TIMEOUT:-300} python3 "$REPO/benchmarks/gpu_tier_moves.py" --out "$RES/gtm" ${GTM_ARGS:-}
  echo "gpu_tier_moves exit $?"
  # the same bytes in 2 long boundaries (16k tokens each): the per-boundary fixed cost amortised
  timeout ${GTM_TIMEOUT:-300} python3 "$REPO/benchmarks/gpu_tier_moves.py" --out "$RES/gtm_long" \
    --checkpoints 2 --kv-tokens 32768 ${GTM_ARGS:-}
  echo "gpu_tier_moves (long) exit $?"
  ;;
*)
  echo "unknown phase $PHASE (all, differential, ab, det, probe, spec, profile, tiermoves)"
  exit 2
  ;;
esac
nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee "$RES/gpu_apps_after.csv"
grep -c "memory leak detected" "$RES"/logs*/*.log > "$RES/idle_leak_reports.txt" 2>/dev/null
cat "$RES/idle_leak_reports.txt"
for f in "$RES"/logs/diag_*.log; do
  [ -f "$f" ] && grep -A14 "slot trace" "$f" > "$RES/diag_slot_trace.txt"
done
# keep the server logs small enough to come back: their last 300 lines
for f in "$RES"/logs*/*.log; do
  [ -f "$f" ] && tail -n 300 "$f" > "$f.tail" && mv "$f.tail" "$f"
done
du -sh "$RES"
