#!/usr/bin/env bash
# The GPU measurements of issue 12 (fused kernels by default, compile, ZeRO-3, scaling), on the 2xH200 machine,
# with .wheels carried (see ../shared/device/README.md):
#
#     BUDGET_S=960 bash benchmarks/h200_issue12.sh suite   # EVERY figure of the issue, 3 runs (processes) per
#                                               # setup (751 s on 2xH200 before the tuned ZeRO-3 loop joined
#                                               # both phases; ~920 s with it): phase 1 the one-GPU setups on both GPUs
#                                               # at once, phase 2 the two-GPU runs, then issue12_table.py's table
#                                               # in $OUT/table.txt. The default BUDGET_S (555) fits one 10-minute
#                                               # device command and cuts the last round; docs/benchmarks.md says
#                                               # how the whole suite ran in the background across two commands.
#     GPUS=4 BUDGET_S=1380 bash benchmarks/h200_issue12.sh suite   # on nvidia-h200-x4: the same figures with the
#                                               # one-GPU setups on four GPUs at once, the two-GPU runs on two pairs
#                                               # at once, and the four-GPU runs (scaling 1 -> 4, ZeRO-3 memory per
#                                               # GPU against 16Ψ/N), all 3 runs per setup: 901 s on
#                                               # 2026-11-30 (BUDGET_S=1000 would have held it)
#     GPUS=8 BUDGET_S=1500 bash benchmarks/h200_issue12.sh suite   # on an 8-GPU machine (none lent so far): the
#                                               # one-GPU setups on four of the GPUs at once (GPU 0-3 lists as with
#                                               # GPUS=4), the eight-GPU runs, then the two-GPU runs on four pairs at
#                                               # once (scaling 1 -> 2 and 1 -> 8; ZeRO-3's memory per GPU measured
#                                               # at 8 GPUs, not projected); the eight-GPU runs are the long part
#                                               # (estimated ~50 s a run): run it in the background, as docs say
#     bash benchmarks/h200_issue12.sh explore3  # candidate scaling fixes (NCCL CTAs, bf16 gradients, prefetch) on 2
#                                               # GPUs, against one-GPU ddp/fsdp baselines measured first, < 570 s
#     bash benchmarks/h200_issue12.sh single    # GPU 0: plain loop vs the user's AdamW (fused by default / as
#                                               # written) and compile; GPU 1 at the same time: the hand-written
#                                               # DeepSpeed ZeRO-2/ZeRO-3 loops vs lightspeed's stages 2/3
#     bash benchmarks/h200_issue12.sh scaling   # tokens/s per GPU on 1 and 2 GPUs
#     bash benchmarks/h200_issue12.sh profile   # profile_step.py: ZeRO-3 vs DeepSpeed's loop, ddp/fsdp on 1 and 2
#     bash benchmarks/h200_issue12.sh final     # every figure in one invocation, then issue12_table.py's table
#
# Everything lands in $OUT (default ./out): per part a table (.txt), the runs' JSON lines (.err/.log) and JSON.
# suite/explore3 only: DRY=1 prints the commands and budgets without running anything; CPU=1 runs the same plumbing
# on CPU with the tiny GPT (a check of this script, not a measurement; put the venv's python3 first in PATH);
# BUDGET_S (default 555) ends the measuring; REPEATS (3), WARMUP (3), STEPS (12), PER_RUN_TIMEOUT (150, one-GPU
# runs); PHASES=1 or 2 runs one phase only, with the whole budget; the setup lists: SUITE1_GPU0, SUITE1_GPU1,
# SUITE2 (suite), EXPLORE3_GPU0, EXPLORE3_GPU1, EXPLORE3 and EXPLORE3_REPEATS (explore3), each comma-separated.
# suite with DC=1: DeepSpeed(stage=3, deepcompile=True) joins, `deepspeed_stage_3+user+dc` at the end of GPU 0's list
# and `deepspeed_stage_3+dc` of SUITE2 (each run warms up 8 steps and may take 420 s: gpu_suite.for_setup), and the
# prelude builds DeepSpeed's dc extension too. Its compilation takes host cores for ~3 minutes per process, which
# slows GPU 1's host-bound ZeRO-3 runs beside it (docs/benchmarks.md, eighth session): read phase 1's ZeRO-3 figures
# with that in mind, or run the DeepCompile setups with benchmarks/h200_dc.sh.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
exec 3>&1  # DRY=1 prints the commands on the script's own stdout, whatever a command's output is redirected to
T0=$SECONDS
if [ -z "${CPU:-}${DRY:-}" ]; then
    python3 -m pip install -q --no-deps .wheels/*.whl 2>&1 | tail -n 2
fi
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 \
       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
       TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
if [ -n "${CPU:-}" ]; then TINY_SUITE=--tiny; TINY_MG="--cpu --tiny"; else TINY_SUITE=; TINY_MG=; fi
WARMUP=${WARMUP:-3} STEPS=${STEPS:-12} REPEATS=${REPEATS:-3}

run() {  # a command, or with DRY=1 its text
    if [ -n "${DRY:-}" ]; then echo "+ CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all} $*" >&3; else "$@"; fi
}

prelude() {  # machine facts and DeepSpeed's FusedAdam (DC=1: and dc) op built once, before any timed run ($1: log)
    [ -n "${CPU:-}${DRY:-}" ] && return
    { nvidia-smi --query-gpu=name,memory.total --format=csv; nproc; free -g; python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
    H200_FUNCS_ONLY=1 source benchmarks/h200_env.sh
    build_ops ${DC:+dc} >> "$1"
}

one_gpu_lists() {  # BUDGET_S REPEATS TAG LIST0 [LIST1 ...]: gpu_suite.py on GPU i with LISTi, every GPU at once,
    # each list round robin over its setups, in $OUT/TAG_a.json (GPU 0), TAG_b.json (GPU 1), ...; all are cut at
    # BUDGET_S (a run cut short keeps what it measured: gpu_suite writes its JSON after every run). An empty list
    # runs nothing (never gpu_suite's default list).
    local budget=$1 repeats=$2 tag=$3 gpu=0 letters=abcdefgh list
    shift 3
    local S="python3 benchmarks/gpu_suite.py --repeats $repeats --windows 1 --warmup $WARMUP --steps $STEPS \
--per-run-timeout ${PER_RUN_TIMEOUT:-150} $TINY_SUITE"
    for list in "$@"; do
        local f="$OUT/${tag}_${letters:$gpu:1}"
        if [ -n "$list" ]; then
            CUDA_VISIBLE_DEVICES=$gpu run timeout -k 8 "$budget" $S --only "$list" --json "$f.json" > "$f.log" 2>&1 &
        fi
        gpu=$(( gpu + 1 ))
    done
    wait
}

n_gpus() {  # BUDGET_S LIST REPEATS JSON LOG N: multi_gpu.py's scaling section on N GPUs only (round robin), on the
    # GPUs CUDA_VISIBLE_DEVICES names (all by default)
    [ -n "$2" ] || return 0
    run timeout -k 8 "$1" python3 benchmarks/multi_gpu.py --devices "$6" --counts "$6" --sections scaling \
        --module user --micro-batch 8 --repeats "$3" --windows 1 --warmup "$WARMUP" --steps "$STEPS" \
        --per-run-timeout 150 $TINY_MG --strategies "$2" --json "$4" > "$5" 2>&1
}

budget_left() {  # seconds from now to the end of the measuring budget ($BUDGET_S after the script started)
    echo $(( BUDGET_S - (SECONDS - T0) ))
}

case "${1:-}" in
suite|explore3)
    # suite: every figure of issue 12 in one command. explore3: the lead's scaling exploration. Both end before
    # $BUDGET_S (default 555 s; each phase is cut with `timeout -k 8`, so + 8 s at worst, + the table's ~3 s)
    # whatever happens, and print the table from what was measured.
    #   phase 1: the one-GPU setups, every GPU at once (one process per run, round robin over each GPU's list so
    #            slow drift hits every setup alike). suite: the ZeRO-3 pair, whose step is CPU-bound, shares
    #            one GPU's list (never beside the compile setup on 2 GPUs, whose inductor workers take many cores)
    #            and runs while GPU 0 runs its eager setups; the lists are balanced by estimated run times.
    #   GPUS=4 or 8 (suite only), phase N: the N-GPU runs on every GPU, round robin, before phase 2, so a budget
    #            cut falls on the two-GPU rounds, measured in every suite since the first, not on the N-GPU ones.
    #   phase 2: the two-GPU runs, round robin, until the budget; GPUS=4: two pairs at once (GPUs 0,1: SUITE2_A,
    #            GPUs 2,3: SUITE2_B, the ZeRO-3 setups together); GPUS=8: four pairs (SUITE2_A to SUITE2_D).
    BUDGET_S=${BUDGET_S:-555}
    GPUS=${GPUS:-2}
    LOG="$OUT/$1.log"
    echo "[h200_issue12] $1 $(date -u +%FT%TZ) warmup $WARMUP steps $STEPS gpus $GPUS" > "$LOG"
    prelude "$LOG"
    PN_LIST=
    if [ "$1" = suite ] && { [ "$GPUS" = 4 ] || [ "$GPUS" = 8 ]; }; then
        # ~60-80 s a round on each GPU (one-GPU run walls: ~19 s eager, ~30 s ZeRO-3 and compile); with 8 GPUs the
        # same four lists (GPUs 4-7 idle in phase 1: its length is GPU 0's list, and the pairs stay comparable)
        P1_LISTS=("${SUITE1_GPU0:-single+user+compile,plain_pytorch,single+user}"
                  "${SUITE1_GPU1:-ddp+user,fsdp+user,plain_deepspeed_zero2}"
                  "${SUITE1_GPU2:-plain_deepspeed_zero3,deepspeed_stage_3+user}"
                  "${SUITE1_GPU3:-deepspeed_stage_2+user,plain_deepspeed_zero3_tuned}")
        if [ "$GPUS" = 4 ]; then
            P2_GROUPS=("0,1" "2,3")  # ~100 s and ~130 s a round (two-GPU run walls: 22-60 s)
            P2_LISTS=("${SUITE2_A:-ddp,fsdp,deepspeed_stage_2,plain_ddp}"
                      "${SUITE2_B:-deepspeed_stage_3,plain_deepspeed_zero3,plain_deepspeed_zero3_tuned}")
            PN_LIST=${SUITE4:-ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp}
            # of what is left: phase 1 took 165 s, phase 4 430 s, phase 2 265 s (41 s prelude) on 2026-11-30
            P1_SHARE=${P1_SHARE:-19} PN_SHARE=${PN_SHARE:-60}
        else
            P2_GROUPS=("0,1" "2,3" "4,5" "6,7")  # the ZeRO-3 setups of issue 12's ratios share a pair
            P2_LISTS=("${SUITE2_A:-ddp,plain_ddp}" "${SUITE2_B:-fsdp,deepspeed_stage_2}"
                      "${SUITE2_C:-deepspeed_stage_3,plain_deepspeed_zero3}" "${SUITE2_D:-plain_deepspeed_zero3_tuned}")
            PN_LIST=${SUITE8:-ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp}
            # estimates (never run on 8 GPUs): phase 1 ~210 s, phase 8 ~18 runs of ~50 s, phase 2 ~150 s
            P1_SHARE=${P1_SHARE:-15} PN_SHARE=${PN_SHARE:-80}
        fi
        P1_REPEATS=$REPEATS P2_REPEATS=$REPEATS
    elif [ "$1" = suite ]; then
        P1_LISTS=("${SUITE1_GPU0:-single+user+compile,plain_pytorch,single+user,ddp+user,fsdp+user,plain_deepspeed_zero2}"
                  "${SUITE1_GPU1:-deepspeed_stage_2+user,plain_deepspeed_zero3,deepspeed_stage_3+user,plain_deepspeed_zero3_tuned}")
        P2_GROUPS=("0,1")
        P2_LISTS=("${SUITE2:-ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp,plain_deepspeed_zero3_tuned}")
        if [ -n "${DC:-}" ]; then
            P1_LISTS[0]=${P1_LISTS[0]},deepspeed_stage_3+user+dc P2_LISTS[0]=${P2_LISTS[0]},deepspeed_stage_3+dc
        fi
        P1_REPEATS=$REPEATS P2_REPEATS=$REPEATS
        # P1_SHARE: % of what is left after the prelude: est. phase 1 ~345 s, phase 2 ~480 s before plain_ddp
        # (the hand-written torch DDP loop, ddp's baseline) joined SUITE2; its runs are not timed on the H200s yet
        # (a guess: ~30 s a round, as ddp's)
        P1_SHARE=${P1_SHARE:-38}  # with plain_deepspeed_zero3_tuned in both phases: ~330 s and ~560 s
    else
        P1_LISTS=("${EXPLORE3_GPU0:-plain_pytorch,single+user}" "${EXPLORE3_GPU1:-ddp+user,fsdp+user}")
        P2_GROUPS=("0,1")
        P2_LISTS=("${EXPLORE3:-ddp,ddp+bf16,ddp+ctas8,ddp+bf16+ctas8,fsdp,fsdp+ctas8,deepspeed_stage_3,deepspeed_stage_3+prefetch1e8,deepspeed_stage_3+ctas8}")
        P1_REPEATS=$REPEATS
        P2_REPEATS=${EXPLORE3_REPEATS:-1}
        P1_SHARE=${P1_SHARE:-36}  # phase 1: 6 runs per GPU; phase 2: 9 two-GPU runs
    fi
    PHASES=${PHASES:-1,2${PN_LIST:+,$GPUS}}  # PHASES=1, 2 or N: that phase only, with the whole budget (same table)
    case "$PHASES" in *[248]*) ;; *) P1_SHARE=100 ;; esac
    case "$PHASES" in *1*) ;; *) P1_LISTS=() ;; esac
    case "$PHASES" in *2*) ;; *) P2_LISTS=() PN_SHARE=100 ;; esac
    case "$PHASES" in *[48]*) ;; *) PN_LIST= ;; esac
    P1_S=${P1_S:-$(( $(budget_left) * P1_SHARE / 100 ))}
    echo "[h200_issue12] prelude $(( SECONDS - T0 )) s; phase 1 budget $P1_S s: ${P1_LISTS[*]:-(none)} x $P1_REPEATS" \
        | tee -a "$LOG" >&3
    start=$SECONDS
    [ "${#P1_LISTS[@]}" -gt 0 ] && one_gpu_lists "$P1_S" "$P1_REPEATS" "$1_1gpu" "${P1_LISTS[@]}"
    P1_WALL=$(( SECONDS - start ))
    PN_WALL=0
    if [ -n "$PN_LIST" ]; then
        PN_S=$(( $(budget_left) * ${PN_SHARE:-100} / 100 ))
        echo "[h200_issue12] phase 1 took $P1_WALL s; phase $GPUS budget $PN_S s: $PN_LIST x $P2_REPEATS" \
            | tee -a "$LOG" >&3
        start=$SECONDS
        [ "$PN_S" -gt 20 ] && n_gpus "$PN_S" "$PN_LIST" "$P2_REPEATS" "$OUT/$1_${GPUS}gpu.json" \
            "$OUT/$1_${GPUS}gpu.log" "$GPUS"
        PN_WALL=$(( SECONDS - start ))
    fi
    P2_S=$(budget_left)
    echo "[h200_issue12] phase 1 took $P1_WALL s${PN_LIST:+, phase $GPUS $PN_WALL s}; phase 2 budget $P2_S s:" \
        "${P2_LISTS[*]:-(none)} x $P2_REPEATS" | tee -a "$LOG" >&3
    start=$SECONDS
    SCALING=() ROWS=
    for i in "${!P2_LISTS[@]}"; do
        f="$OUT/$1_2gpu"
        [ "${#P2_LISTS[@]}" -gt 1 ] && f="${f}_$(echo abcdefgh | cut -c $(( i + 1 )))"
        SCALING+=("$f.json") ROWS=$ROWS${ROWS:+,}${P2_LISTS[$i]}
        if [ "$P2_S" -gt 20 ] && [ -n "${P2_LISTS[$i]}" ]; then
            CUDA_VISIBLE_DEVICES=${P2_GROUPS[$i]} n_gpus "$P2_S" "${P2_LISTS[$i]}" "$P2_REPEATS" "$f.json" "$f.log" 2 &
        fi
    done
    wait
    P2_WALL=$(( SECONDS - start ))
    COUNTS=2
    if [ -n "$PN_LIST" ]; then
        SCALING+=("$OUT/$1_${GPUS}gpu.json") COUNTS=2,$GPUS ROWS=  # the table's own order (its default rows)
    fi
    run python3 benchmarks/issue12_table.py "$OUT/$1_1gpu_"?.json --scaling "${SCALING[@]}" --devices "$COUNTS" \
        --rows "${ROWS:-ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp,plain_deepspeed_zero3_tuned}" \
        > "$OUT/table.txt" 2>&1
    [ -n "${DRY:-}" ] || cat "$OUT/table.txt" >> "$LOG"
    echo "[h200_issue12] $1 done: prelude + phase 1 $P1_WALL s${PN_LIST:+ + phase $GPUS $PN_WALL s}" \
        "+ phase 2 $P2_WALL s," \
        "total $(( SECONDS - T0 )) s" | tee -a "$LOG" >&3
    ;;
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
    echo "usage: $0 suite|explore3|single|scaling|profile|explore|final|final1|final2" >&2; exit 2 ;;
esac
