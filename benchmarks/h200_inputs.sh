#!/usr/bin/env bash
# Float inputs on one GPU (issue 12): how batches reach the device, on nvidia-h200 with .wheels carried:
#
#     OUT=/tmp/S bash benchmarks/h200_inputs.sh tests inputs fp32 gpt   # any of the parts, in the order given
#
# tests   the GPU tests of the batch path (tests/test_batch_mover.py), the fp32 hint, and the GPU tests that feed
#         batches through other strategies and the guard (tests/test_gpu.py)
# inputs  gpu_inputs.py: ViT-B/16 at batch 256 from a DataLoader with 8 workers, REPEATS runs each (default 3):
#         the plain loop as users write it, pinned, pinned + side stream; lightspeed by default and as_given
# fp32    gpu_inputs.py in precision="32-true", torch's matmul precision "highest" against "high" (TF32)
# gpt     gpu_suite.py: the 1.28B GPT (token ids), plain loop against lightspeed single, the user's AdamW
# strategies  gpu_inputs.py, ViT-B/16 as in inputs: DeepSpeed's own ZeRO-2 loop as users write it, against
#         lightspeed's deepspeed_stage_2, deepspeed_stage_3 and fsdp on one GPU (and the plain loops)
# wait    gpu_inputs.py on a ViT-S/16 (a step short enough for the loader to matter), 0 and 8 loader workers:
#         lightspeed's data_wait figure and line against the speed more workers actually give
# augment gpu_inputs.py on a ViT-S/16 with uint8 images, 0 and 8 loader workers: the flip, conversion and
#         normalisation in the dataset (CPU), against the same in the module's on_after_batch_transfer (GPU)
#
# Each part writes $OUT/<part>.log (and .json); "parts done" is the last line of $OUT/progress.txt.
set -u
source benchmarks/h200_env.sh
REPEATS=${REPEATS:-3}
for part in "$@"; do
    case $part in
        tests) build_ops > "$OUT/ops.log"
               timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_batch_mover.py \
                   tests/test_kernels.py tests/test_gpu.py -k "mover or pinned or matmul or guard_skips or \
matches_single_gpu_in_bf16" > "$OUT/tests.log" 2>&1 ;;
        inputs) timeout 330 python3 benchmarks/gpu_inputs.py --repeats "$REPEATS" --workers 8 --json "$OUT/inputs.json" \
                    --only plain,plain+pin,plain+pin+stream,single,single+as_given > "$OUT/inputs.log" 2>&1 ;;
        strategies) timeout 420 python3 benchmarks/gpu_inputs.py --repeats "$REPEATS" --workers 8 --steps 20 \
                        --json "$OUT/strategies.json" --only plain,plain+pin,single,plain_deepspeed,deepspeed_stage_2,\
deepspeed_stage_3,fsdp > "$OUT/strategies.log" 2>&1 ;;
        fp32) timeout 150 python3 benchmarks/gpu_inputs.py --repeats 1 --workers 8 --steps 20 --json "$OUT/fp32.json" \
                  --only single,single+fp32,single+fp32+tf32 > "$OUT/fp32.log" 2>&1 ;;
        gpt) timeout 150 python3 benchmarks/gpu_suite.py --repeats 2 --warmup 3 --steps 20 --json "$OUT/gpt.json" \
                 --only plain_pytorch,single+user > "$OUT/gpt.log" 2>&1 ;;
        wait) for w in 0 8; do
                  timeout 120 python3 benchmarks/gpu_inputs.py --size vit_s16 --repeats 1 --workers $w --warmup 5 \
                      --steps 60 --json "$OUT/wait$w.json" --only plain+pin,single > "$OUT/wait$w.log" 2>&1
              done ;;
        augment) for w in 0 8; do
                     timeout 240 python3 benchmarks/gpu_inputs.py --size vit_s16 --repeats "$REPEATS" --workers $w \
                         --warmup 5 --steps 60 --json "$OUT/augment$w.json" \
                         --only plain+pin+aug_cpu,single+aug_cpu,single+aug_gpu > "$OUT/augment$w.log" 2>&1
                 done ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
    echo "$part: rc $?" >> "$OUT/progress.txt"
done
echo "parts done" >> "$OUT/progress.txt"
