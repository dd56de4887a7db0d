#!/usr/bin/env bash
# One model's frontier over two GPUs of one host, for a model whose autoplan and rows do not fit one
# 10-minute job together (resnet152: each compilation takes 97-119 s cold on an H100). Run both
# roles at once, each on its own GPU (benchmarks/per_gpu.sh):
#
#     bash benchmarks/frontier_split.sh autoplan MODEL LOGDIR   # autoplan at 1.0x and 1.5x, then its two rows
#     bash benchmarks/frontier_split.sh rows MODEL LOGDIR       # the compiled anchors compiled ahead; then,
#                                                               # once autoplan has answered, every row in one process
#
# The rows job measures autoplan's answers as rows `answer_fast` (1.0x) and `answer_small` (1.5x),
# beside every anchor and hand recipe, in one process (frontier.py's same-run table); autoplan's
# own seconds are in the autoplan job's JSON. Both jobs share the host's inductor cache, so the rows
# job compiles the answers from what autoplan compiled.
set -u
role=$1; model=$2; logdir=$3
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$logdir"
if [ "$role" = autoplan ]; then
    # --json appends, and the rows job must not read an earlier run's answers: written whole, at the end.
    rm -f "$logdir/$model-auto.json" "$logdir/$model-auto.json.part"
    python3 "$here/frontier.py" --model "$model" --configs auto_fast,auto_small --json "$logdir/$model-auto.json.part" \
        && mv "$logdir/$model-auto.json.part" "$logdir/$model-auto.json"
    exit
fi
python3 "$here/frontier.py" --model "$model" --warm-only
echo "anchors compiled ahead at $SECONDS s" >&2
until [ -s "$logdir/$model-auto.json" ] || [ $SECONDS -gt 560 ]; do sleep 5; done
[ -s "$logdir/$model-auto.json" ] || { echo "no answers from the autoplan job" >&2; exit 1; }
plans=$(python3 - "$logdir/$model-auto.json" <<'PY'
import json, sys
rows = {r["config"]: r for r in map(json.loads, open(sys.argv[1]))}
for auto, name in (("auto_fast", "answer_fast"), ("auto_small", "answer_small")):
    print(f"{name}={rows[auto]['plan']}")
PY
)
args=()
while IFS= read -r p; do args+=(--plan "$p"); done <<< "$plans"
python3 "$here/frontier.py" --model "$model" --json "$logdir/$model-rows.json" "${args[@]}" \
    --configs base_fp32,amp_bf16,ckpt_every_block,ckpt_every_block+bf16,sac_every_block+bf16,compile,compile+bf16,fast,small,fast_compiled,small_compiled,answer_fast,answer_small
