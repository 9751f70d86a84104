#!/usr/bin/env bash
# Step profiles (benchmarks/profile_step.py) on a 2xH200 machine, .wheels carried. Each list holds profile_step
# argument strings separated by ';': ONE0 runs on GPU 0 while ONE1 runs on GPU 1, then TWO on both GPUs.
#     ONE0="--setup deepspeed_stage_3 --cprofile" ONE1="--setup ddp" TWO="--setup deepspeed_stage_3 --trace T" \
#         bash benchmarks/h200_trace.sh
# A `--trace NAME` lands (gzipped) in $OUT/NAME.json.gz; every run's output in $OUT/NN.log; the summary lines last.
source benchmarks/h200_env.sh
build_ops
profile() {  # TAG GPU-ENV DEVICES ARGS
    local args=$4 trace
    trace=$(sed -n 's/.*--trace \([A-Za-z0-9_]*\).*/\1/p' <<< "$args")
    [ -n "$trace" ] && args=${args/--trace $trace/--trace \/tmp\/$trace.json}
    env $2 timeout ${PER_RUN:-170} python3 benchmarks/profile_step.py --devices "$3" $args > "$OUT/$1.log" 2>&1
    [ -n "$trace" ] && gzip -c "/tmp/$trace.json" > "$OUT/$trace.json.gz"
    return 0
}
each() {  # TAG-PREFIX GPU-ENV DEVICES LIST
    local i=0
    IFS=';' read -ra items <<< "$4"
    for a in "${items[@]}"; do i=$((i + 1)); profile "$1$i" "$2" "$3" "$a"; done
}
each g0_ CUDA_VISIBLE_DEVICES=0 1 "${ONE0:-}" &
each g1_ CUDA_VISIBLE_DEVICES=1 1 "${ONE1:-}"
wait
each two_ CUDA_VISIBLE_DEVICES=0,1 2 "${TWO:-}"
for f in "$OUT"/*.log; do
    echo "== $(basename "$f")"
    grep -h "^SETUP\|^STEP\|^TRACE\|^  \+[0-9.]\+ ms\|Error\|error:" "$f" | head -30
done
