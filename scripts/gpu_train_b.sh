#!/usr/bin/env bash
# The GPU-trained SmolLM2 drafter of docs/benchmarks.md (issues 27, 28): 2 layers, width 2304, a 64-row context
# window, 8,000 prompts, a 16,000-step cosine schedule of 512 anchors, in /tmp/tr (resumable: a second call
# continues the same work folder). Progress bars are dropped from the log. On the lent device a call returns at most
# 8 files from $OUT: bring the 54 MB weights back alone (split -b 15M: 4 pieces) or in fewer, larger pieces.
#   [PROMPTS=N STEPS=N SEQS=N KV=BYTES] scripts/gpu_train_b.sh MINUTES TIMEOUT_S LOG
set -uo pipefail
minutes=$1; limit=$2; log=$3
mkdir -p /tmp/tr
timeout "$limit" deepinfer train-drafter --model smollm2-135m-instruct --drafter dspark --device cuda \
    --set model.dtype=float32 --set scheduler.max_num_seqs=${SEQS:-256} --set plugins.attention.enabled=true \
    --set cache.kv_cache_bytes=${KV:-8000000000} --recipe prompts=${PROMPTS:-8000} --recipe held_out=96 --recipe max_reply_tokens=256 \
    --recipe steps=${STEPS:-16000} --recipe batch=512 --set plugins.spec_decode.dspark_num_layers=2 \
    --set plugins.spec_decode.dspark_intermediate_size=2304 --set plugins.spec_decode.dspark_context_window=64 \
    --minutes "$minutes" --output /tmp/tr/b.safetensors 2>&1 | tr '\r' '\n' | grep -v "step/s\|req/s\|seq/s" > "$log"
