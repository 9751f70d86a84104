#!/usr/bin/env bash
# The GPU benchmarks, one entry point. On a lent GPU machine, from the project root, with .wheels carried
# (../shared/device/README.md):
#
#     OUT=/tmp/S bash benchmarks/gpu.sh PART [PART ...]       # the parts in the order given
#     OUT=/tmp/S bash benchmarks/gpu.sh run python3 benchmarks/speed_single_gpu.py --only ...   # any command
#     source benchmarks/gpu.sh                               # the environment only, in this shell
#
# Once per invocation, before any part: the DeepSpeed wheels installed, the environment every GPU run needs
# exported (PYTHONPATH=src, TORCH_CUDA_ARCH_LIST=9.0 for DeepSpeed's op builder, NVLink multicast off:
# NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1, the ops' build folder), the
# machine's GPUs, cores, memory and torch in $OUT/machine.txt. The DeepSpeed ops a part needs (FusedAdam;
# CPUAdam for offload; DeepCompile's extension for `+dc` setups) are built once, before anything is timed.
#
# Parts (docs/benchmarks.md gives each published table's exact command):
#   suite        one-GPU speed against the hand-written loops (speed_single_gpu.py), scaling per GPU and
#                ZeRO-3's memory between steps against 16Ψ/N (scaling_multi_gpu.py), then suite_table.py's
#                tables in $OUT/table.txt; 3 runs per setup. GPUS=2 (default), 4 or 8; see "suite" below
#   variants     scaling_multi_gpu.py lists: VARIANTS_GPU0 on GPU 0 beside VARIANTS_GPU1 on GPU 1, then
#                VARIANTS_TWO on both; REPEATS (2) each, round robin; a median table at the end. The default
#                lists compare DeepSpeed(stage=3, deepcompile=True) with ZeRO-3's hooks and DeepSpeed's loop
#   interleaved  scaling_multi_gpu.py --counts 1,2: the one- and two-GPU runs of STRATEGIES (deepspeed_stage_3)
#                interleaved in time, REPEATS (3) each, cut at MEASURE_S (300)
#   parity       scaling_multi_gpu.py --sections parity,scaling on 2 GPUs (micro-batch 4, per-step losses)
#   memory       scaling_multi_gpu.py --sections memory (2.29B GPT), then fit (the model DDP cannot fit, each
#                GPU capped at 16 GiB)
#   speed        speed_single_gpu.py on one GPU: SPEED (the suite's one-GPU rows), REPEATS (2), 20 steps
#   single       speed_single_gpu.py: the single-device step against the plain loop at micro-batch 8 and 1,
#                with the guard's probes (+readnow, +nonorm): SINGLE, REPEATS (3)
#   compile      speed_single_gpu.py: compile=True against torch.compile's own best: COMPILE (+COMPILE_EXTRA)
#   largest      speed_single_gpu.py under a 16 GiB cap: the largest plain model, offloaded ZeRO-3 at 116
#                layers, FSDP offload at 80, the offloaded step's accumulation (LARGEST picks; > 10 minutes)
#   planner      planner_forecast.py (the forecast against the measured peak), planner_cap.py (strategy and
#                micro-batch "auto" under a 16 GiB cap)
#   inputs       input_pipeline.py, ViT-B/16 from a DataLoader (8 workers): the plain loops, lightspeed
#   inputs_strategies  the same under DeepSpeed's own loop and lightspeed's deepspeed/fsdp strategies
#   inputs_fp32  the same at precision "32-true", matmul precision "highest" against "high" (TF32)
#   inputs_wait  ViT-S/16 with 0 and 8 loader workers: lightspeed's data-wait figure against the real speed-up
#   inputs_augment  ViT-S/16, uint8 images: the transform on CPU (dataset) against on_after_batch_transfer (GPU)
#   profile      profile_step.py lists: PROFILE_GPU0 beside PROFILE_GPU1, then PROFILE_TWO (2 GPUs); each a
#                ';'-separated list of argument strings; `--trace NAME` lands in $OUT/NAME.json.gz
#   tests        the GPU tests: pytest -m gpu TEST_FILES (-k TEST_K), cut at TEST_S (420); STOP_ON_FAIL=1
#                stops the invocation when they fail
#   run CMD...   CMD in the environment (the rest of the line), after FusedAdam's build (NO_OPS=1: none)
#
# Every part writes $OUT/<part>.log (and .json where the script writes one) and appends "<part>: rc N, S s"
# to $OUT/progress.txt; "parts done" is its last line. A run longer than one 10-minute device command runs
# in the background and a later command polls for it (a lent machine left idle goes back, with the run):
#     mkdir -p /tmp/S; OUT=/tmp/S setsid nohup bash benchmarks/gpu.sh suite > /tmp/S/stdout.txt 2>&1 < /dev/null &
#     for i in $(seq 1 110); do grep -q "parts done" /tmp/S/progress.txt 2>/dev/null && break; sleep 5; done
#
# Every part: DRY=1 prints the commands without running anything; CPU=1 runs the same plumbing on CPU with the
# tiny models (a check of this script, not a measurement; put the venv's python3 first in PATH). WARMUP,
# STEPS and REPEATS override every part's own defaults.
#
# suite: phase 1 runs the one-GPU setups on every GPU at once (one list per GPU, round robin over its setups;
# the ZeRO-3 pair, whose step is bound by the host, shares one list), phase N (GPUS=4 or 8) the N-GPU runs,
# phase 2 the two-GPU runs (one pair, or two/four pairs at once). BUDGET_S (555 s, one device command; the
# whole suite takes ~960 s on 2 GPUs, ~900 s on 4) cuts every phase so the table always prints; P1_SHARE and
# PN_SHARE split it; PHASES=1, 2 or N runs that phase only, with the whole budget. Lists (comma-separated):
# SUITE1_GPU0 ... SUITE1_GPU3, SUITE2 (GPUS=2) or SUITE2_A ... SUITE2_D (pairs), SUITE4, SUITE8; REPEATS2 the
# runs per two-GPU setup. DC=1 adds DeepSpeed(stage=3, deepcompile=True) to GPU 0's list and SUITE2 (each run
# warms up 8 steps and may take 420 s; its compilation takes host cores for ~3 minutes, which slows the
# host-bound ZeRO-3 runs beside it: prefer `variants` for DeepCompile).

OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -n "${CPU:-}" ]; then TINY=--tiny TINY_MG="--cpu --tiny"; else TINY= TINY_MG=; fi
if [ -z "${CPU:-}${DRY:-}" ] && compgen -G ".wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-deps .wheels/*.whl 2>&1 | tail -n 2
fi
export PYTHONPATH=src PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 \
       TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
[ "${BASH_SOURCE[0]}" != "$0" ] && return 0  # sourced: the environment only

set -u
exec 3>&1  # DRY=1 prints the commands on the script's own stdout, wherever a command's output goes
T0=$SECONDS
if [ -z "${CPU:-}${DRY:-}" ]; then
    { nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv; nproc; free -g
      python3 -c "import torch; print(torch.__version__)"; } > "$OUT/machine.txt" 2>&1
fi

run() {  # a command, or with DRY=1 its text
    if [ -n "${DRY:-}" ]; then echo "+ CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-all} $*" >&3; else "$@"; fi
}

BUILT=" "
ops() {  # FusedAdamBuilder CPUAdamBuilder DeepCompileBuilder ...: DeepSpeed's ops, each built once
    local code="from deepspeed.accelerator import get_accelerator as a" name
    [ -n "${CPU:-}${DRY:-}" ] && return 0
    for name in "$@"; do
        case "$BUILT" in *" $name "*) continue ;; esac
        BUILT="$BUILT$name "
        if [ "$name" = DeepCompileBuilder ]; then
            code="$code; from deepspeed.ops.op_builder.dc import DeepCompileBuilder; DeepCompileBuilder().load()"
        else
            code="$code; a().create_op_builder('$name').load()"
        fi
    done
    [ "$code" = "from deepspeed.accelerator import get_accelerator as a" ] && return 0
    local t=$SECONDS
    if timeout 300 python3 -c "$code; print('ops ready')" >> "$OUT/ops.log" 2>&1; then
        echo "ops $* built in $(( SECONDS - t )) s" >> "$OUT/ops.log"
    else
        echo "ops $* FAILED after $(( SECONDS - t )) s (is .wheels carried?)" | tee -a "$OUT/ops.log" >&2
    fi
}

dc_ops() {  # the dc extension too when a list names a DeepCompile setup
    case "$*" in *+dc*) ops FusedAdamBuilder DeepCompileBuilder ;; *) ops FusedAdamBuilder ;; esac
}

speed() {  # LIMIT_S JSON LOG speed_single_gpu.py arguments
    local limit=$1 json=$2 log=$3
    shift 3
    run timeout -k 8 "$limit" python3 benchmarks/speed_single_gpu.py $TINY --json "$json" "$@" > "$log" 2>&1
}

multi() {  # LIMIT_S JSON LOG scaling_multi_gpu.py arguments
    local limit=$1 json=$2 log=$3
    shift 3
    run timeout -k 8 "$limit" python3 benchmarks/scaling_multi_gpu.py $TINY_MG --json "$json" "$@" > "$log" 2>&1
}

inputs() {  # LIMIT_S NAME input_pipeline.py arguments
    local limit=$1 name=$2
    shift 2
    run timeout -k 8 "$limit" python3 benchmarks/input_pipeline.py $TINY --json "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1
}

medians() {  # scaling_multi_gpu.py JSON files: one line per setup and GPU count, the median and every run
    [ -n "${DRY:-}" ] && return 0
    python3 - "$@" <<'EOF'
import json, statistics, sys
from pathlib import Path
rows = {}
for f in sys.argv[1:]:
    if not Path(f).exists():
        continue
    for r in json.loads(Path(f).read_text()).values():
        if "tok_s_per_gpu" in r:
            rows.setdefault((r["strategy"], r["devices"]), []).append((r["tok_s_per_gpu"], r.get("peak_gib")))
for (name, n), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    tok = [t for t, _ in runs]
    peak = max((p for _, p in runs if p is not None), default=float("nan"))
    print(f"{name:42s} {n} GPU  median {statistics.median(tok):8.0f}  runs {[round(t) for t in tok]}  "
          f"peak {peak:.1f} GiB")
EOF
}

# ---- suite ---------------------------------------------------------------------------------------------

one_gpu_lists() {  # BUDGET_S REPEATS TAG LIST0 [LIST1 ...]: speed_single_gpu.py on GPU i with LISTi, every GPU
    # at once, each list round robin, in $OUT/TAG_a.json (GPU 0), TAG_b.json (GPU 1), ...; all cut at BUDGET_S
    # (speed_single_gpu.py writes its JSON after every run). An empty list runs nothing.
    local budget=$1 repeats=$2 tag=$3 gpu=0 letters=abcdefgh list
    shift 3
    for list in "$@"; do
        local f="$OUT/${tag}_${letters:$gpu:1}"
        if [ -n "$list" ]; then
            CUDA_VISIBLE_DEVICES=$gpu speed "$budget" "$f.json" "$f.log" --repeats "$repeats" --windows 1 \
                --warmup "$WARMUP_S" --steps "$STEPS_S" --per-run-timeout "${PER_RUN_TIMEOUT:-150}" \
                --only "$list" &
        fi
        gpu=$(( gpu + 1 ))
    done
    wait
}

n_gpus() {  # BUDGET_S LIST REPEATS JSON LOG N: scaling_multi_gpu.py on N GPUs only (round robin), on the GPUs
    # CUDA_VISIBLE_DEVICES names (all by default)
    [ -n "$2" ] || return 0
    multi "$1" "$4" "$5" --devices "$6" --counts "$6" --sections scaling --module user --micro-batch 8 \
        --repeats "$3" --windows 1 --warmup "$WARMUP_S" --steps "$STEPS_S" --per-run-timeout 150 --strategies "$2"
}

budget_left() {  # seconds from now to the end of the measuring budget ($BUDGET_S after the part started)
    echo $(( BUDGET_S - (SECONDS - SUITE_T0) ))
}

# the two-GPU setups of the suite and the scaling rows of its table
SUITE_ROWS=ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp,plain_deepspeed_zero3_tuned

part_suite() {
    WARMUP_S=${WARMUP:-3} STEPS_S=${STEPS:-12}
    local repeats=${REPEATS:-3} log="$OUT/suite.log"
    BUDGET_S=${BUDGET_S:-555} SUITE_T0=$SECONDS
    local gpus=${GPUS:-2} pn_list= p1_share pn_share=100
    local -a p1_lists p2_groups p2_lists
    echo "[suite] $(date -u +%FT%TZ) warmup $WARMUP_S steps $STEPS_S gpus $gpus" > "$log"
    ops FusedAdamBuilder ${DC:+DeepCompileBuilder}
    if [ "$gpus" = 4 ] || [ "$gpus" = 8 ]; then
        # ~60-80 s a round on each GPU (one-GPU run walls: ~19 s eager, ~30 s ZeRO-3 and compile); with 8 GPUs
        # the same four lists (GPUs 4-7 idle in phase 1, and the pairs stay comparable)
        p1_lists=("${SUITE1_GPU0:-single+user+compile,plain_pytorch,single+user}"
                  "${SUITE1_GPU1:-ddp+user,fsdp+user,plain_deepspeed_zero2}"
                  "${SUITE1_GPU2:-plain_deepspeed_zero3,deepspeed_stage_3+user}"
                  "${SUITE1_GPU3:-deepspeed_stage_2+user,plain_deepspeed_zero3_tuned}")
        if [ "$gpus" = 4 ]; then
            p2_groups=("0,1" "2,3")  # ~100 s and ~130 s a round (two-GPU run walls: 22-60 s)
            p2_lists=("${SUITE2_A:-ddp,fsdp,deepspeed_stage_2,plain_ddp}"
                      "${SUITE2_B:-deepspeed_stage_3,plain_deepspeed_zero3,plain_deepspeed_zero3_tuned}")
            pn_list=${SUITE4:-ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp}
            # 2026-11-30, of what was left after a 41 s prelude: phase 1 165 s, phase 4 430 s, phase 2 265 s
            p1_share=${P1_SHARE:-19} pn_share=${PN_SHARE:-60}
        else
            p2_groups=("0,1" "2,3" "4,5" "6,7")  # the ZeRO-3 setups of the ratios share a pair
            p2_lists=("${SUITE2_A:-ddp,plain_ddp}" "${SUITE2_B:-fsdp,deepspeed_stage_2}"
                      "${SUITE2_C:-deepspeed_stage_3,plain_deepspeed_zero3}"
                      "${SUITE2_D:-plain_deepspeed_zero3_tuned}")
            pn_list=${SUITE8:-ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3,plain_deepspeed_zero3,plain_ddp}
            # estimates (never run on 8 GPUs): phase 1 ~210 s, phase 8 ~18 runs of ~50 s, phase 2 ~150 s
            p1_share=${P1_SHARE:-15} pn_share=${PN_SHARE:-80}
        fi
    else
        local gpu0=single+user+compile,plain_pytorch,single+user,ddp+user,fsdp+user,plain_deepspeed_zero2
        local gpu1=deepspeed_stage_2+user,plain_deepspeed_zero3,deepspeed_stage_3+user,plain_deepspeed_zero3_tuned
        p1_lists=("${SUITE1_GPU0:-$gpu0}" "${SUITE1_GPU1:-$gpu1}")
        p2_groups=("0,1")
        p2_lists=("${SUITE2:-$SUITE_ROWS}")
        if [ -n "${DC:-}" ]; then
            p1_lists[0]=${p1_lists[0]},deepspeed_stage_3+user+dc p2_lists[0]=${p2_lists[0]},deepspeed_stage_3+dc
        fi
        p1_share=${P1_SHARE:-38}  # ~330 s of phase 1 and ~560 s of phase 2 when nothing is cut
    fi
    local p2_repeats=${REPEATS2:-$repeats} phases=${PHASES:-1,2${pn_list:+,$gpus}}
    case "$phases" in *[248]*) ;; *) p1_share=100 ;; esac
    case "$phases" in *1*) ;; *) p1_lists=() ;; esac
    case "$phases" in *2*) ;; *) p2_lists=() pn_share=100 ;; esac
    case "$phases" in *[48]*) ;; *) pn_list= ;; esac
    local p1_s=${P1_S:-$(( $(budget_left) * p1_share / 100 ))} start
    echo "[suite] phase 1 budget $p1_s s: ${p1_lists[*]:-(none)} x $repeats" | tee -a "$log" >&3
    start=$SECONDS
    [ "${#p1_lists[@]}" -gt 0 ] && one_gpu_lists "$p1_s" "$repeats" suite_1gpu "${p1_lists[@]}"
    local p1_wall=$(( SECONDS - start )) pn_wall=0
    if [ -n "$pn_list" ]; then
        local pn_s=$(( $(budget_left) * pn_share / 100 ))
        echo "[suite] phase 1 took $p1_wall s; phase $gpus budget $pn_s s: $pn_list x $p2_repeats" \
            | tee -a "$log" >&3
        start=$SECONDS
        [ "$pn_s" -gt 20 ] && n_gpus "$pn_s" "$pn_list" "$p2_repeats" "$OUT/suite_${gpus}gpu.json" \
            "$OUT/suite_${gpus}gpu.log" "$gpus"
        pn_wall=$(( SECONDS - start ))
    fi
    local p2_s i f rows= counts=2
    local -a scaling=()
    p2_s=$(budget_left)
    echo "[suite] phase 2 budget $p2_s s: ${p2_lists[*]:-(none)} x $p2_repeats" | tee -a "$log" >&3
    start=$SECONDS
    for i in "${!p2_lists[@]}"; do
        f="$OUT/suite_2gpu"
        [ "${#p2_lists[@]}" -gt 1 ] && f="${f}_$(echo abcdefgh | cut -c $(( i + 1 )))"
        scaling+=("$f.json") rows=$rows${rows:+,}${p2_lists[$i]}
        if [ "$p2_s" -gt 20 ] && [ -n "${p2_lists[$i]}" ]; then
            CUDA_VISIBLE_DEVICES=${p2_groups[$i]} n_gpus "$p2_s" "${p2_lists[$i]}" "$p2_repeats" "$f.json" \
                "$f.log" 2 &
        fi
    done
    wait
    local p2_wall=$(( SECONDS - start ))
    if [ -n "$pn_list" ]; then
        scaling+=("$OUT/suite_${gpus}gpu.json") counts=2,$gpus rows=  # the table's own order (its default rows)
    fi
    run python3 benchmarks/suite_table.py "$OUT"/suite_1gpu_?.json --scaling "${scaling[@]}" --devices "$counts" \
        --rows "${rows:-$SUITE_ROWS}" \
        > "$OUT/table.txt" 2>&1
    [ -n "${DRY:-}" ] || cat "$OUT/table.txt" >> "$log"
    echo "[suite] done: phase 1 $p1_wall s${pn_list:+, phase $gpus $pn_wall s}, phase 2 $p2_wall s," \
        "total $(( SECONDS - SUITE_T0 )) s" | tee -a "$log" >&3
}

# ---- the other parts ----------------------------------------------------------------------------------

part_variants() {
    local one0=${VARIANTS_GPU0-deepspeed_stage_3+dc} one1=${VARIANTS_GPU1-deepspeed_stage_3,plain_deepspeed_zero3}
    local two=${VARIANTS_TWO-deepspeed_stage_3+dc,deepspeed_stage_3,plain_deepspeed_zero3}
    local -a m=(--sections scaling --module user --micro-batch 8 --windows 1 --repeats "${REPEATS:-2}"
                --warmup "${WARMUP:-3}" --steps "${STEPS:-12}" --per-run-timeout "${PER_RUN_TIMEOUT:-150}")
    dc_ops "$one0,$one1,$two"
    [ -n "$one0" ] && CUDA_VISIBLE_DEVICES=0 multi "${V1_S:-330}" "$OUT/variants_1a.json" "$OUT/variants_1a.log" \
        "${m[@]}" --devices 1 --counts 1 --strategies "$one0" &
    [ -n "$one1" ] && CUDA_VISIBLE_DEVICES=1 multi "${V1_S:-330}" "$OUT/variants_1b.json" "$OUT/variants_1b.log" \
        "${m[@]}" --devices 1 --counts 1 --strategies "$one1"
    wait
    [ -n "$two" ] && multi "${V2_S:-560}" "$OUT/variants_2.json" "$OUT/variants_2.log" \
        "${m[@]}" --devices 2 --counts 2 --strategies "$two"
    medians "$OUT"/variants_*.json | tee "$OUT/variants.txt"
}

part_interleaved() {
    ops FusedAdamBuilder
    multi "${MEASURE_S:-300}" "$OUT/interleaved.json" "$OUT/interleaved.log" --devices 2 --counts 1,2 \
        --sections scaling --module user --micro-batch 8 --repeats "${REPEATS:-3}" --windows 1 \
        --warmup "${WARMUP:-3}" --steps "${STEPS:-12}" --per-run-timeout 150 \
        --strategies "${STRATEGIES:-deepspeed_stage_3}"
    medians "$OUT/interleaved.json" | tee "$OUT/interleaved.txt"
}

part_parity() {
    ops FusedAdamBuilder
    multi "${PART_S:-560}" "$OUT/parity.json" "$OUT/parity.log" --devices 2 --sections parity,scaling
}

part_memory() {
    ops FusedAdamBuilder CPUAdamBuilder
    multi "${PART_S:-360}" "$OUT/memory.json" "$OUT/memory.log" --devices 2 --sections memory
    multi "${PART_S:-400}" "$OUT/memory_fit.json" "$OUT/memory_fit.log" --devices 2 --sections fit \
        --cap-gib 16 --fit-lo 12 --fit-hi 24
}

part_speed() {
    local list=plain_pytorch,single+user,single+user+compile,plain_deepspeed_zero2,deepspeed_stage_2+user
    list=${SPEED:-$list,plain_deepspeed_zero3,deepspeed_stage_3+user,fsdp+user}
    dc_ops "$list"
    speed "${PART_S:-560}" "$OUT/speed.json" "$OUT/speed.log" --repeats "${REPEATS:-2}" --warmup "${WARMUP:-3}" \
        --steps "${STEPS:-20}" --only "$list"
}

part_single() {
    local list=${SINGLE:-plain_pytorch,single+user,single+user+readnow,single+user+nonorm}
    speed "${PART_S:-560}" "$OUT/single_mb8.json" "$OUT/single_mb8.log" --repeats "${REPEATS:-3}" \
        --warmup "${WARMUP:-3}" --steps "${STEPS:-30}" --only "$list"
    speed "${PART_S:-560}" "$OUT/single_mb1.json" "$OUT/single_mb1.log" --micro-batch 1 --repeats "${REPEATS:-3}" \
        --warmup "${WARMUP:-5}" --steps "${STEPS:-60}" --only "$list"
}

part_compile() {
    local list=${COMPILE:-plain_pytorch,plain_pytorch+compile+loss,single+user,single+user+compile}
    list+=${COMPILE_EXTRA-,single+user+compile+regional}
    speed "${PART_S:-560}" "$OUT/compile.json" "$OUT/compile.log" --repeats "${REPEATS:-3}" \
        --warmup "${WARMUP:-3}" --steps "${STEPS:-30}" --only "$list"
}

part_largest() {
    local which=${LARGEST:-plain,zero3_offload,fsdp_offload,accumulate}
    ops FusedAdamBuilder CPUAdamBuilder
    case ",$which," in *,plain,*)
        speed 560 "$OUT/largest_plain.json" "$OUT/largest_plain.log" --memory-cap 16 --only plain_pytorch \
            --lo 14 --hi 24 ;; esac
    case ",$which," in *,zero3_offload,*)  # 116 layers: 5.91B parameters, ~100 GiB of host memory
        OMP_NUM_THREADS=16 speed 580 "$OUT/largest_zero3.json" "$OUT/largest_zero3.log" --memory-cap 16 \
            --only deepspeed_stage_3_offload_opt+ac+unpinned --lo 116 --hi 116 --probe-timeout 540 ;; esac
    case ",$which," in *,fsdp_offload,*)
        OMP_NUM_THREADS=12 speed 580 "$OUT/largest_fsdp.json" "$OUT/largest_fsdp.log" --memory-cap 16 \
            --only fsdp_offload --lo 80 --hi 80 --probe-timeout 540 ;; esac
    case ",$which," in *,accumulate,*)
        speed 580 "$OUT/largest_accumulate.json" "$OUT/largest_accumulate.log" --offload-speed --memory-cap 16 \
            --layers 80 ;; esac
}

part_planner() {
    ops FusedAdamBuilder CPUAdamBuilder
    run timeout -k 8 "${PART_S:-560}" python3 benchmarks/planner_forecast.py --json "$OUT/planner_forecast.json" \
        > "$OUT/planner_forecast.log" 2>&1
    run timeout -k 8 300 python3 benchmarks/planner_cap.py $TINY --out "$OUT/planner_cap" \
        > "$OUT/planner_cap.log" 2>&1
}

part_inputs() {
    inputs 330 inputs --repeats "${REPEATS:-3}" --workers 8 \
        --only plain,plain+pin,plain+pin+stream,single,single+as_given
}

part_inputs_strategies() {
    ops FusedAdamBuilder
    inputs 420 inputs_strategies --repeats "${REPEATS:-2}" --workers 8 --steps "${STEPS:-20}" \
        --only plain,plain+pin,single,plain_deepspeed,deepspeed_stage_2,deepspeed_stage_3,fsdp
}

part_inputs_fp32() {
    inputs 150 inputs_fp32 --repeats 1 --workers 8 --steps "${STEPS:-20}" \
        --only single,single+fp32,single+fp32+tf32
}

part_inputs_wait() {
    local w
    for w in 0 8; do
        inputs 120 "inputs_wait$w" --size vit_s16 --repeats 1 --workers $w --warmup 5 --steps 60 \
            --only plain+pin,single
    done
}

part_inputs_augment() {
    local w
    for w in 0 8; do
        inputs 240 "inputs_augment$w" --size vit_s16 --repeats "${REPEATS:-2}" --workers $w --warmup 5 --steps 60 \
            --only plain+pin+aug_cpu,single+aug_cpu,single+aug_gpu
    done
}

profile_list() {  # TAG DEVICES LIST (';'-separated profile_step.py argument strings), on the visible GPUs
    local i=0 a trace
    local -a items
    IFS=';' read -ra items <<< "$3"
    for a in "${items[@]}"; do
        i=$((i + 1))
        trace=$(sed -n 's/.*--trace \([A-Za-z0-9_]*\).*/\1/p' <<< "$a")
        [ -n "$trace" ] && a=${a/--trace $trace/--trace \/tmp\/$trace.json}
        run timeout -k 8 "${PER_RUN:-170}" python3 benchmarks/profile_step.py $TINY --devices "$2" $a \
            > "$OUT/profile_$1$i.log" 2>&1
        [ -n "$trace" ] && [ -z "${DRY:-}" ] && gzip -c "/tmp/$trace.json" > "$OUT/$trace.json.gz"
    done
    return 0
}

part_profile() {
    ops FusedAdamBuilder
    local gpu0="--setup plain_deepspeed_zero3;--setup deepspeed_stage_3;--setup deepspeed_stage_3 --cprofile"
    local gpu1="--setup ddp --micro-batch 4;--setup fsdp --micro-batch 4"
    local two="--setup ddp --micro-batch 4 --trace ddp_2;--setup deepspeed_stage_3 --trace ds3_2"
    CUDA_VISIBLE_DEVICES=0 profile_list gpu0_ 1 "${PROFILE_GPU0-$gpu0}" &
    CUDA_VISIBLE_DEVICES=1 profile_list gpu1_ 1 "${PROFILE_GPU1-$gpu1}"
    wait
    profile_list two_ 2 "${PROFILE_TWO-$two}"
    [ -n "${DRY:-}" ] && return 0
    local f
    for f in "$OUT"/profile_*.log; do
        [ -e "$f" ] || continue
        echo "== $(basename "$f")"
        grep -h "^SETUP\|^STEP\|^TRACE\|^  \+[0-9.]\+ ms\|Error\|error:" "$f" | head -30
    done | tee "$OUT/profile.txt"
}

part_tests() {
    local -a k=()
    [ -n "${TEST_K:-}" ] && k=(-k "$TEST_K")
    case "${TEST_K:-}" in *deepcompile*) ops FusedAdamBuilder DeepCompileBuilder ;; *) ops FusedAdamBuilder ;; esac
    run timeout "${TEST_S:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        ${TEST_FILES:-tests/test_gpu.py tests/test_batch_mover.py tests/test_guard.py tests/test_kernels.py} \
        "${k[@]}" > "$OUT/tests.log" 2>&1
    local rc=$?
    [ -n "${DRY:-}" ] || tail -n 3 "$OUT/tests.log"
    if [ $rc != 0 ] && [ "${STOP_ON_FAIL:-0}" = 1 ]; then
        echo "tests: rc $rc, $(( SECONDS - T0 )) s" >> "$OUT/progress.txt"
        echo "parts done (stopped: the tests failed)" >> "$OUT/progress.txt"
        exit 1
    fi
    return $rc
}

PARTS="suite variants interleaved parity memory speed single compile largest planner inputs inputs_strategies
inputs_fp32 inputs_wait inputs_augment profile tests"
[ $# -gt 0 ] || { echo "usage: $0 PART [PART ...] | run CMD...; parts:" $PARTS >&2; exit 2; }
for part in "$@"; do  # refuse a misspelt part before anything runs
    [ "$part" = run ] && break
    case " $(echo $PARTS) " in *" $part "*) ;; *) echo "unknown part $part; parts:" $PARTS >&2; exit 2 ;; esac
done
while [ $# -gt 0 ]; do
    part=$1
    shift
    start=$SECONDS
    if [ "$part" = run ]; then
        [ -n "${NO_OPS:-}" ] || ops FusedAdamBuilder
        run "$@"
        rc=$?
        set --
    else
        "part_$part"
        rc=$?
    fi
    echo "$part: rc $rc, $(( SECONDS - start )) s" | tee -a "$OUT/progress.txt" >&3
done
echo "parts done in $(( SECONDS - T0 )) s" >> "$OUT/progress.txt"
