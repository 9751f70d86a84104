#!/usr/bin/env bash
# The GPU measurements of 2026-11-29 behind docs/benchmarks.md, in three parts that each fit one 10-minute device command.
# Run from the project root on the 2×H200 machine, with .wheels carried (see ../shared/device/README.md):
#
#     bash benchmarks/h200_session.sh timed-multi     # parity and scaling on 1 and 2 GPUs (nothing else runs)
#     bash benchmarks/h200_session.sh memory          # memory per GPU, largest model on 2 GPUs, and (GPU 0)
#                                                     # the 6x probe of the single-GPU memory-cap search
#     bash benchmarks/h200_session.sh timed-single    # the single-GPU speed table on GPU 1; FSDP offload on GPU 0
#
# Parts run side by side only where nothing is timed on the same GPU. Everything lands in $OUT (default ./out).
# On 2026-11-29 the memory part's fit section ran out of time after the ZeRO-3 attempt; its last row was run on its
# own (docs/benchmarks.md gives that command). The memory part can exceed one 10-minute command: split it there.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps .wheels/*.whl 2>&1 | tail -n 2
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"

build_ops() {  # DeepSpeed's CPU Adam and fused Adam, compiled once per machine (about a minute each)
    python3 -c "from deepspeed.accelerator import get_accelerator as a; \
[a().create_op_builder(n).load() for n in ('CPUAdamBuilder', 'FusedAdamBuilder')]; print('ops ready')"
}

case "${1:-}" in
timed-multi)
    { nvidia-smi topo -m; free -g; nproc; } > "$OUT/machine.txt" 2>&1
    build_ops > "$OUT/ops.log" 2>&1 &
    timeout 560 python3 benchmarks/multi_gpu.py --devices 2 --sections parity,scaling \
        --json "$OUT/multi_parity_scaling.json" > "$OUT/multi_parity_scaling.txt" 2> "$OUT/multi_parity_scaling.err"
    wait
    ;;
memory)
    # GPU 0, capped at 16 GiB: ZeRO-3 with the optimizer offloaded to pageable host memory at 116 layers (5.91B).
    CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=16 timeout 560 python3 benchmarks/gpu_suite.py --memory-cap 16 \
        --only deepspeed_stage_3_offload_opt+ac+unpinned --lo 116 --hi 116 --probe-timeout 540 \
        --json "$OUT/cap116.json" > "$OUT/cap116.txt" 2> "$OUT/cap116.err" &
    timeout 360 python3 benchmarks/multi_gpu.py --devices 2 --sections memory \
        --json "$OUT/multi_memory.json" > "$OUT/multi_memory.txt" 2> "$OUT/multi_memory.err"
    timeout 400 python3 benchmarks/multi_gpu.py --devices 2 --sections fit --cap-gib 16 --fit-lo 12 --fit-hi 24 \
        --json "$OUT/multi_fit.json" > "$OUT/multi_fit.txt" 2> "$OUT/multi_fit.err"
    wait
    ;;
timed-single)
    CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=12 timeout 560 python3 benchmarks/gpu_suite.py --memory-cap 16 \
        --only fsdp_offload --lo 80 --hi 80 --probe-timeout 540 \
        --json "$OUT/fsdp_offload80.json" > "$OUT/fsdp_offload80.txt" 2> "$OUT/fsdp_offload80.err" &
    CUDA_VISIBLE_DEVICES=1 timeout 560 python3 benchmarks/gpu_suite.py \
        --only plain_pytorch,fsdp_grad_op,fsdp+ac,deepspeed_stage_3+ac,single+compile+loss \
        --json "$OUT/speed.json" > "$OUT/speed.txt" 2> "$OUT/speed.err"
    wait
    ;;
*)
    echo "usage: $0 timed-multi | memory | timed-single" >&2
    exit 2
    ;;
esac
tail -n 40 "$OUT"/*.txt
