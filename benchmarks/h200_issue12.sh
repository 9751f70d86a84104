#!/usr/bin/env bash
# The GPU measurements of issue 12 (fused kernels by default, compile, ZeRO-3, scaling), on the 2xH200 machine,
# with .wheels carried (see ../shared/device/README.md). Each part fits one 10-minute device command:
#
#     bash benchmarks/h200_issue12.sh single    # GPU 0: plain loop vs the user's AdamW (fused by default / as
#                                               # written) and compile; GPU 1 at the same time: the hand-written
#                                               # DeepSpeed ZeRO-2/ZeRO-3 loops vs lightspeed's stages 2/3
#     bash benchmarks/h200_issue12.sh scaling   # tokens/s per GPU on 1 and 2 GPUs
#     bash benchmarks/h200_issue12.sh profile   # profile_step.py: ZeRO-3 vs DeepSpeed's loop, ddp/fsdp on 1 and 2
#     bash benchmarks/h200_issue12.sh final     # every figure in one invocation, then issue12_table.py's table
#
# Everything lands in $OUT (default ./out): per part a table (.txt), the runs' JSON lines (.err) and JSON.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps .wheels/*.whl 2>&1 | tail -n 2
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"

case "${1:-}" in
single)
    { nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
    python3 -c "from deepspeed.accelerator import get_accelerator as a; \
[a().create_op_builder(n).load() for n in ('FusedAdamBuilder',)]; print('ops ready')" > "$OUT/ops.log" 2>&1
    A=plain_pytorch,single+user,single+user+as_written,single+user+compile
    B=plain_deepspeed_zero2,deepspeed_stage_2+user,plain_deepspeed_zero3,deepspeed_stage_3+user
    CUDA_VISIBLE_DEVICES=0 timeout 540 python3 benchmarks/gpu_suite.py --only $A --repeats 3 --steps 15 \
        --json "$OUT/single_a.json" > "$OUT/single_a.txt" 2> "$OUT/single_a.err" &
    CUDA_VISIBLE_DEVICES=1 timeout 540 python3 benchmarks/gpu_suite.py --only $B --repeats 3 --steps 15 \
        --json "$OUT/single_b.json" > "$OUT/single_b.txt" 2> "$OUT/single_b.err"
    wait
    ;;
final)
    # Every figure of the issue in one invocation (~9 min). Each setup is one process whose timed steps give
    # 3 windows (samples); ratios are taken within this run. 1) GPU-bound one-GPU pairs, the two GPUs at
    # once; 2) the CPU-bound one-GPU setups (ZeRO-3, FSDP) alone, so no neighbour takes their CPU; 3) 2 GPUs.
    { nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
    python3 -c "from deepspeed.accelerator import get_accelerator as a; \
a().create_op_builder('FusedAdamBuilder').load(); print('ops ready')" >> "$OUT/final.log" 2>&1
    S="python3 benchmarks/gpu_suite.py --repeats 1 --windows 3 --warmup 4 --steps 24 --per-run-timeout 150"
    CUDA_VISIBLE_DEVICES=0 timeout 190 $S --only plain_pytorch,single+user,single+user+compile \
        --json "$OUT/suite_a.json" >> "$OUT/final.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 190 $S --only plain_deepspeed_zero2,deepspeed_stage_2+user,ddp+user \
        --json "$OUT/suite_b.json" >> "$OUT/final_b.log" 2>&1
    wait
    CUDA_VISIBLE_DEVICES=0 timeout 160 $S --only plain_deepspeed_zero3,deepspeed_stage_3+user,fsdp+user \
        --json "$OUT/suite_c.json" >> "$OUT/final.log" 2>&1
    timeout 225 python3 benchmarks/multi_gpu.py --devices 2 --counts 2 --sections scaling --module user \
        --micro-batch 8 --repeats 1 --windows 3 --warmup 4 --steps 24 \
        --strategies deepspeed_stage_3,plain_deepspeed_zero3,ddp,fsdp,deepspeed_stage_2 \
        --json "$OUT/scaling.json" >> "$OUT/final.log" 2>&1
    cat "$OUT/final_b.log" >> "$OUT/final.log"; rm -f "$OUT/final_b.log"
    python3 benchmarks/issue12_table.py "$OUT"/suite_?.json --scaling "$OUT/scaling.json" | tee "$OUT/table.txt"
    ;;
explore)
    # Candidate defaults (multi_gpu.py's variant names): ZeRO-3 with each Block one leaf module, DDP bucket size
    # and static graph, FSDP's bf16 reduce-scatter; and stage 2 on 2 GPUs, never measured before.
    python3 -c "from deepspeed.accelerator import get_accelerator as a; \
a().create_op_builder('FusedAdamBuilder').load(); print('ops ready')" > "$OUT/ops.log" 2>&1
    M="python3 benchmarks/multi_gpu.py --devices 2 --sections scaling --module user --micro-batch 8 --repeats 1 \
       --windows 3 --warmup 4 --steps 16"
    CUDA_VISIBLE_DEVICES=0 timeout 200 $M --devices 1 --counts 1 --strategies deepspeed_stage_3+leaf \
        --json "$OUT/explore_1a.json" > "$OUT/explore_1a.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 timeout 200 $M --devices 1 --counts 1 --strategies plain_deepspeed_zero3 \
        --json "$OUT/explore_1b.json" > "$OUT/explore_1b.log" 2>&1
    wait
    timeout 420 $M --counts 2 --strategies ${EXPLORE:-deepspeed_stage_3+leaf,plain_deepspeed_zero3,ddp+bucket100,ddp+static,fsdp+bf16reduce,deepspeed_stage_2} \
        --json "$OUT/explore_2.json" > "$OUT/explore_2.log" 2>&1
    ;;
final1|final2)
    # Every figure of the issue with 3 runs (processes) per setup, on one warm 2xH200 machine in two device
    # commands (each is limited to 10 minutes): final1 the one-GPU setups, both GPUs at once (GPU 0: the plain
    # loop, the user's module single/compile and ddp in a group of one; GPU 1: the DeepSpeed loops and stages,
    # fsdp); final2 the two-GPU runs. Then: python3 benchmarks/issue12_table.py OUT/suite_?.json --scaling
    # OUT/scaling.json
    { nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
    python3 -c "from deepspeed.accelerator import get_accelerator as a; \
a().create_op_builder('FusedAdamBuilder').load(); print('ops ready')" >> "$OUT/$1.log" 2>&1
    if [ "$1" = final1 ]; then
        S="python3 benchmarks/gpu_suite.py --repeats 3 --windows 1 --warmup 3 --steps 12 --per-run-timeout 120"
        CUDA_VISIBLE_DEVICES=0 timeout 540 $S --only plain_pytorch,single+user,single+user+compile,ddp+user \
            --json "$OUT/suite_a.json" > "$OUT/final1_a.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=1 timeout 540 $S --only \
            plain_deepspeed_zero2,deepspeed_stage_2+user,plain_deepspeed_zero3,deepspeed_stage_3+user,fsdp+user \
            --json "$OUT/suite_b.json" > "$OUT/final1_b.log" 2>&1
        wait
    else
        timeout 545 python3 benchmarks/multi_gpu.py --devices 2 --counts 2 --sections scaling --module user \
            --micro-batch 8 --repeats 3 --windows 1 --warmup 3 --steps 12 \
            --strategies ${FINAL2:-deepspeed_stage_3,plain_deepspeed_zero3,ddp,fsdp,deepspeed_stage_2} \
            --json "$OUT/scaling.json" > "$OUT/final2.log" 2>&1
    fi
    ;;
profile)
    # Where the step's time goes (benchmarks/profile_step.py): ZeRO-3 against DeepSpeed's own loop on GPU 0,
    # while GPU 1 profiles ddp and fsdp on one GPU; then ddp and fsdp on both GPUs.
    python3 -c "from deepspeed.accelerator import get_accelerator as a; \
a().create_op_builder('FusedAdamBuilder').load(); print('ops ready')" > "$OUT/ops.log" 2>&1
    P="timeout 170 python3 benchmarks/profile_step.py"
    { for s in plain_deepspeed_zero3 deepspeed_stage_3 "deepspeed_stage_3 --legacy-guard" deepspeed_stage_3+ds_defaults; do
        CUDA_VISIBLE_DEVICES=0 $P --setup $s; done; } > "$OUT/profile_gpu0.log" 2>&1 &
    { for s in "ddp --micro-batch 4" "fsdp --micro-batch 4" "fsdp --micro-batch 8"; do
        CUDA_VISIBLE_DEVICES=1 $P --setup $s; done; } > "$OUT/profile_gpu1.log" 2>&1
    wait
    { for s in "ddp --micro-batch 4" "fsdp --micro-batch 4" "fsdp --micro-batch 4 --legacy-guard"; do
        $P --devices 2 --setup $s; done; } > "$OUT/profile_2gpu.log" 2>&1
    tar czf "$OUT/torch_extensions.tgz" .torch_extensions
    ;;
scaling)
    timeout 560 python3 benchmarks/multi_gpu.py --devices 2 --sections scaling --repeats 1 --steps 20 \
        --strategies ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3 \
        --json "$OUT/scaling.json" > "$OUT/scaling.txt" 2> "$OUT/scaling.err"
    ;;
*)
    echo "usage: $0 single|scaling|profile|explore|final|final1|final2" >&2; exit 2 ;;
esac
