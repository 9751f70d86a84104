"""The DeepSpeed benchmark of the DeepSpeed issue: a hand-written DeepSpeed ZeRO-2 loop against
lightspeed's `deepspeed_stage_2` on the same 1.3B GPT and DeepSpeed settings, then the memory-cap
search.

    python benchmarks/gpu_deepspeed.py             # speed table, then largest model under a 16 GiB
    cap

It is a thin front for gpu_suite.py, which holds the loops; run that script directly for other
setups.
"""

import subprocess
import sys
from pathlib import Path

SUITE = Path(__file__).resolve().parent / "gpu_suite.py"

if __name__ == "__main__":
    extra = sys.argv[1:]
    subprocess.run(
        [sys.executable, SUITE, "--only", "plain_deepspeed_zero2,deepspeed_stage_2", *extra],
        check=True,
    )
    subprocess.run(
        [
            sys.executable,
            SUITE,
            "--memory-cap",
            "16",
            "--only",
            "plain_pytorch,deepspeed_stage_3_offload_full",
            *extra,
        ],
        check=True,
    )
