#!/usr/bin/env bash
# Issue 33 item 4: the retrieval grid of one checkpoint through the engine as served (bounded replay,
# FP4 cache, the checkpoint's top-k), with `dsv41 eval`: passkey, single NIAH, multi-key NIAH (4 keys,
# 1 asked), vartrack (4 hops) over lengths x depths, and indexer recall per layer and length.
#
#   benchmarks/bench_long_context.sh CHECKPOINT OUT [LENGTHS] [SAMPLES] [DEPTHS]
#
# LENGTHS defaults to 192,384,768,1536: the recipe's training length is 384 (tiny's window is 8 tokens),
# so 768 and 1536 (4x) are extrapolation. Multi-key NIAH and 4-hop vartrack need more than 192 tokens
# with the 1K BPE, so they start at LONG_LENGTHS (default 384,768,1536). ONLY=task1,task2 runs a subset;
# EVAL_FLAGS adds engine options to every served task (not recall, which runs the model directly) (e.g. "--fused-kernels off": on a loaded 2-core machine the
# background kernel build kept a 2-layer model's eval from finishing in 5 minutes; off, 13 s).
# Each task writes OUT/NAME.{json,md,png}.
set -euo pipefail
ck=${1:?checkpoint folder}
out=${2:?output folder}
lengths=${3:-192,384,768,1536}
samples=${4:-2}
depths=${5:-0,0.25,0.5,0.75,1}
common=(--model "$ck" --lengths "$lengths" --depths "$depths" --samples "$samples" --out "$out"
        --threads "${THREADS:-1}" --extrapolate ${EVAL_FLAGS:-})
long=(--lengths "${LONG_LENGTHS:-384,768,1536}")
only=",${ONLY:-passkey,niah,niah_k4,vartrack,recall},"
[[ $only == *,passkey,* ]] && python -m dsv41.cli eval passkey "${common[@]}"
[[ $only == *,niah,* ]] && python -m dsv41.cli eval niah "${common[@]}"
[[ $only == *,niah_k4,* ]] && python -m dsv41.cli eval niah "${common[@]}" "${long[@]}" --keys 4 --queries 1
[[ $only == *,vartrack,* ]] && python -m dsv41.cli eval vartrack "${common[@]}" "${long[@]}" --hops 4
[[ $only == *,recall,* ]] && python -m dsv41.cli eval recall --model "$ck" --lengths "$lengths" --out "$out" \
    --threads "${THREADS:-1}" --extrapolate
true
