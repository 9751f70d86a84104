#!/usr/bin/env bash
# DeepSpeed's DeepCompile against hook-driven ZeRO-3, on 1 and 2 GPUs (a 2xH200 machine, .wheels carried):
#     OUT=/tmp/D setsid nohup bash benchmarks/h200_dc.sh > /tmp/D/stdout.txt 2>&1 < /dev/null &
# then poll for "dc done" in /tmp/D/stdout.txt (the whole run outlasts one 10-minute device command). Poll within the
# same command that starts it and again at once when a command ends: a lent machine left idle for its release time
# (30 s in the ninth session) goes back, and the background run with it.
# First (TESTS=1, the default) the GPU tests of DeepSpeed(deepcompile=True): tests/test_gpu.py -k deepcompile
# (parity with the hooks and a resume, on 1 and 2 GPUs; validation and activation checkpointing on 1; TEST_K picks
# others) into $OUT/gpu_test.log (STOP_ON_FAIL=1: stop there if they fail; TEST_S, default 420, bounds them). Then
# multi_gpu.py's scaling runs (RUNS=0: none, the tests only): ONE0 on GPU 0 beside ONE1 on GPU 1, then TWO on both,
# REPEATS (1) times each, round robin. DeepCompile recompiles at its 6th step with a prefetch schedule measured in
# the first five, so every run warms up for WARMUP (8) steps.
# Each run's line lands in $OUT/dc1_*.log / dc2.log as it ends.
source benchmarks/h200_env.sh
T0=$SECONDS
build_ops dc > "$OUT/ops.log"
echo "ops built in $((SECONDS - T0)) s" >> "$OUT/ops.log"
if [ "${TESTS:-1}" = 1 ]; then
    timeout "${TEST_S:-420}" python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TEST_K:-deepcompile}" > "$OUT/gpu_test.log" 2>&1
    rc=$?
    tail -n 3 "$OUT/gpu_test.log"
    if [ $rc != 0 ] && [ "${STOP_ON_FAIL:-0}" = 1 ]; then echo "dc done in $((SECONDS - T0)) s: tests failed"; exit 1; fi
fi
[ "${RUNS:-1}" = 0 ] && { echo "dc done in $((SECONDS - T0)) s"; exit 0; }
M="python3 benchmarks/multi_gpu.py --sections scaling --module user --micro-batch 8 --repeats ${REPEATS:-1} \
--windows 1 --warmup ${WARMUP:-8} --steps ${STEPS:-12} --per-run-timeout ${PER_RUN:-400}"
CUDA_VISIBLE_DEVICES=0 timeout -k 5 "${ONE_S:-330}" $M --devices 1 --counts 1 \
    --strategies "${ONE0:-deepspeed_stage_3+dc}" --json "$OUT/dc1_a.json" > "$OUT/dc1_a.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout -k 5 "${ONE_S:-330}" $M --devices 1 --counts 1 \
    --strategies "${ONE1:-deepspeed_stage_3,plain_deepspeed_zero3+dc}" --json "$OUT/dc1_b.json" > "$OUT/dc1_b.log" 2>&1
wait
timeout -k 5 "${TWO_S:-600}" $M --devices 2 --counts 2 \
    --strategies "${TWO:-deepspeed_stage_3+dc,deepspeed_stage_3,plain_deepspeed_zero3+dc}" --json "$OUT/dc2.json" \
    > "$OUT/dc2.log" 2>&1
grep -h "^\[multi_gpu\]" "$OUT"/dc*.log | sed 's/"losses[^]]*],//' | cut -c1-260
echo "dc done in $((SECONDS - T0)) s"
