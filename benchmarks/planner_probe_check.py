"""The activation probe against the GPU: what the planner's CPU probe forecasts for a step of each
model family (run as the GPU's kernels run it), against what the same step holds on the GPU.

    python benchmarks/planner_probe_check.py                      # the six families, one GPU
    python benchmarks/planner_probe_check.py --only gpt2,t5 --sizes 1,2,8

For each family of benchmarks/planner_families.py (full size) and micro-batch: the probe's line
(`probe_activations(..., device_type="cuda")` on a CPU copy in bf16, as DeepSpeed runs it: saved
tensors plus the step's working memory at its peak), then the same step on the GPU: a bf16 copy
on CUDA, each parameter's gradient freed once accumulated (the strategies keep gradients
elsewhere), measured as the allocator's peak above what was allocated before the step
(`torch.cuda.max_memory_allocated`), and as the tensors autograd saved. Prints one table: the
forecast over the measurement is the probe's accuracy on this GPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))

from planner_families import GPU, Family  # noqa: E402

from lightspeed.plan.probe import (  # noqa: E402
    _saved_bytes,
    batch_of,
    cast_floats,
    move_to,
    probe_activations,
    stand_in,
)

MIB = 2**20


def on_gpu(model: Family, sample, sizes: list[int]) -> dict[int, tuple[int, int, int]]:
    """(allocator peak above the start, saved bytes, LiveBytes' working bytes) of one step of a
    bf16 copy of `model` on the GPU at each micro-batch."""
    twin = copy.deepcopy(model).to("cuda", torch.bfloat16).train()
    stand_in(twin, model)
    out = {}
    for n in sizes:
        batch = move_to(cast_floats(batch_of(sample, n), torch.bfloat16), torch.device("cuda"))
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        saved, _, _, _, working, _ = _saved_bytes(twin, batch, "bf16-true", gpu=True)
        torch.cuda.synchronize()
        out[n] = (torch.cuda.max_memory_allocated() - start, saved, working)
        del batch
    del twin
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="llama,gpt2,t5,vit,cnn,moe")
    p.add_argument("--sizes", default="1,2,8")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"{'family':7s} {'mb':>3s} {'forecast':>9s} {'(saved':>8s} {'working)':>9s} "
        f"{'gpu peak':>9s} {'gpu saved':>9s} {'gpu work':>9s} {'ratio':>6s} {'probe s':>7s}"
    )
    for family in args.only.split(","):
        spec = GPU[family]
        torch.manual_seed(0)
        model = Family(family, False, spec["seq"], spec["samples"])
        sample = next(iter(DataLoader(model.data, batch_size=1)))
        start = time.perf_counter()
        line = probe_activations(model, cast_floats(sample, torch.bfloat16), "bf16-true", "cuda")
        seconds = time.perf_counter() - start
        measured = on_gpu(model, sample, sizes)
        for n in sizes:
            forecast = line.at(n)
            saved = line.base + line.per_sample * n
            peak, gpu_saved, gpu_working = measured[n]
            print(
                f"{family:7s} {n:3d} {forecast / MIB:8.0f}M {saved / MIB:7.0f}M "
                f"{(forecast - saved) / MIB:8.0f}M {peak / MIB:8.0f}M {gpu_saved / MIB:8.0f}M "
                f"{gpu_working / MIB:8.0f}M {forecast / peak:6.2f} {seconds:7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
