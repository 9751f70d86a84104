#!/usr/bin/env bash
# One-GPU probes of the single-device step (issue 12), on nvidia-h200 with .wheels carried:
#
#     OUT=/tmp/S bash benchmarks/h200_single.sh tests small big   # any of the parts, in the order given
#
# tests    the guard's GPU tests (tests/test_guard.py, tests/test_gpu.py)
# small    the suite's 1.28B GPT at micro-batch 1, where the host's work per step shows: the plain loop, single
#          (the guard's verdict read a step later) and single+readnow (read right after the optimizer step is
#          queued, the code before), single+nonorm (no gradient-norm pass); REPEATS runs each (default 3)
# big      the same GPT at micro-batch 8 (the figure): the same four
# profile  profile_step.py on `single` at micro-batch 1 with cProfile: where the host's time per step goes
# compile  the 1.28B GPT under compile=True, with and without the norm pass (the MFU moonshot's share of it)
# ceiling  the MFU moonshot: the eager plain loop and single, compile=True (the GPT compiled whole on one device),
#          the plain loop's forward and loss in one torch.compile'd function (torch.compile's own best), and
#          compile=True block by block (+regional); CEILING_EXTRA replaces the last (",a,b": more setups)
#
# Each part writes $OUT/<part>.log (the runs' JSON lines and the table) and $OUT/<part>.json.
set -u
source benchmarks/h200_env.sh
REPEATS=${REPEATS:-3}
CEILING=${CEILING:-plain_pytorch,plain_pytorch+compile+loss,single+user,single+user+compile}
CEILING+=${CEILING_EXTRA:-,single+user+compile+regional}
suite() {  # part, then gpu_suite.py arguments
    local part=$1; shift
    timeout "${PART_S:-560}" python3 benchmarks/gpu_suite.py --json "$OUT/$part.json" "$@" > "$OUT/$part.log" 2>&1
    echo "$part: rc $?"; tail -n 12 "$OUT/$part.log"
}
for part in "$@"; do
    case $part in
        tests) timeout 300 python3 -m pytest -q -m gpu tests/test_guard.py tests/test_gpu.py -k guard \
                   -p no:cacheprovider > "$OUT/tests.log" 2>&1
               echo "tests: rc $?"; tail -n 3 "$OUT/tests.log" ;;
        small) suite small --micro-batch 1 --repeats "$REPEATS" --warmup 5 --steps 60 \
                   --only plain_pytorch,single+user,single+user+readnow,single+user+nonorm ;;
        big) suite big --repeats "$REPEATS" --warmup 3 --steps 30 \
                 --only plain_pytorch,single+user,single+user+readnow,single+user+nonorm ;;
        profile) timeout 200 python3 benchmarks/profile_step.py --setup single --micro-batch 1 --cprofile \
                     > "$OUT/profile.log" 2>&1; echo "profile: rc $?" ;;
        compile) suite compile --repeats "$REPEATS" --warmup 3 --steps 30 \
                     --only single+user+compile,single+user+compile+nonorm ;;
        ceiling) suite ceiling --repeats "$REPEATS" --warmup 3 --steps 30 --only "$CEILING" ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
done
