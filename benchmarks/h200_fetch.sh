#!/usr/bin/env bash
# ZeRO-3's parameter fetches on the 2xH200 machine (.wheels carried; ../shared/device/README.md): does the host's
# wait on DeepSpeed's fetch events hold stage 3 back at 2 GPUs? multi_gpu.py's variants (see its `variant`):
# `+eventsN` (the coordinator queues N fetch events before the host waits on the oldest; DeepSpeed's is 2),
# `+fastleaf` (DeepSpeed's fast fetch of leaf blocks: no events at all), beside ddp with NCCL_PROTO=Simple.
#
#     OUT=/tmp/F bash benchmarks/h200_fetch.sh     # < 560 s: ops build, phase 1 (1 GPU, both GPUs at once),
#                                                  # phase 2 (2 GPUs), each list round robin, REPEATS (2) runs
#
# Lists (comma-separated multi_gpu.py names): ONE0 and ONE1 (one GPU each, GPU 0 and GPU 1), TWO (2 GPUs).
# The user module records no per-step losses; the variants' parity is tests/test_benchmarks_and_demo.py's (CPU).
set -u
OUT=${OUT:-out}
source benchmarks/h200_env.sh
REPEATS=${REPEATS:-2}
ONE0=${ONE0:-deepspeed_stage_3,deepspeed_stage_3+events1000}
ONE1=${ONE1:-deepspeed_stage_3+fastleaf,deepspeed_stage_3+events16}
TWO=${TWO:-deepspeed_stage_3,deepspeed_stage_3+events1000,deepspeed_stage_3+fastleaf,deepspeed_stage_3+events16,ddp,ddp+protoSimple}
M="python3 benchmarks/multi_gpu.py --sections scaling --module user --micro-batch 8 --windows 1 --warmup 3 --steps 12
   --per-run-timeout 150 --repeats $REPEATS"
T0=$SECONDS
build_ops > "$OUT/fetch.log"
echo "[h200_fetch] ops $(( SECONDS - T0 )) s" | tee -a "$OUT/fetch.log"
CUDA_VISIBLE_DEVICES=0 timeout -k 8 ${P1_S:-150} $M --devices 1 --counts 1 --strategies "$ONE0" \
    --json "$OUT/fetch_1a.json" > "$OUT/fetch_1a.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout -k 8 ${P1_S:-150} $M --devices 1 --counts 1 --strategies "$ONE1" \
    --json "$OUT/fetch_1b.json" > "$OUT/fetch_1b.log" 2>&1
wait
echo "[h200_fetch] phase 1 done $(( SECONDS - T0 )) s" | tee -a "$OUT/fetch.log"
timeout -k 8 ${P2_S:-330} $M --devices 2 --counts 2 --strategies "$TWO" --json "$OUT/fetch_2.json" \
    > "$OUT/fetch_2.log" 2>&1
echo "[h200_fetch] done $(( SECONDS - T0 )) s" | tee -a "$OUT/fetch.log"
python3 - "$OUT" <<'EOF' | tee -a "$OUT/fetch.log"
import json, statistics, sys
from pathlib import Path
rows = {}
for f in sorted(Path(sys.argv[1]).glob("fetch_*.json")):
    for key, r in json.loads(f.read_text()).items():
        if "tok_s_per_gpu" in r:
            rows.setdefault((r["strategy"], r["devices"]), []).append((r["tok_s_per_gpu"], r.get("peak_gib")))
for (name, n), runs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    tok = [t for t, _ in runs]
    print(f"{name:42s} {n} GPU  median {statistics.median(tok):8.0f}  runs {[round(t) for t in tok]}  "
          f"peak {max(p for _, p in runs):.1f} GiB")
EOF
