#!/usr/bin/env bash
# ZeRO-3's scaling with the one- and two-GPU runs interleaved in time (multi_gpu.py round robin over the GPU
# counts), on a fresh 2xH200 machine, .wheels carried:  MEASURE_S=300 bash benchmarks/h200_pair.sh
# Every run's line lands in $OUT/pair.log as it ends, so a run cut by MEASURE_S loses only itself.
source benchmarks/h200_env.sh
build_ops
timeout -k 5 "${MEASURE_S:-300}" python3 benchmarks/multi_gpu.py --devices 2 --counts 1,2 --sections scaling \
    --module user --micro-batch 8 --repeats "${REPEATS:-3}" --windows 1 --warmup 3 --steps 12 --per-run-timeout 150 \
    --strategies "${STRATEGIES:-deepspeed_stage_3}" --json "$OUT/pair.json" > "$OUT/pair.log" 2>&1
grep -h "^\[multi_gpu\]" "$OUT/pair.log" | sed 's/"losses[^]]*],//' | cut -c1-200
tail -n 12 "$OUT/pair.log"
