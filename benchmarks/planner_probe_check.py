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
import contextlib
import copy
import pickle
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "src"))
sys.path.insert(0, str(ROOT))

from planner_families import GPU, Family  # noqa: E402

from lightspeed.plan.gpu_kernels import GpuKernels  # noqa: E402
from lightspeed.plan.model_copy import batch_of, cast_floats, move_to, stand_in, step_args  # noqa: E402
from lightspeed.plan.probe import (  # noqa: E402
    _probe_copy,
    _saved_bytes,
    is_weight_derived,
    probe_activations,
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


def saved_groups(twin: torch.nn.Module, batch, gpu_kernels: bool) -> dict:
    """What autograd saves in one step of `twin`, one entry per storage (weights and their casts
    excluded, as the probe does): {(shape, dtype, creator): (count, bytes)}."""
    weights = {p.untyped_storage()._cdata for p in twin.parameters()}
    seen: set[int] = set()
    groups: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key in seen or key in weights or is_weight_derived(t):
            return t
        seen.add(key)
        creator = type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf"
        g = (tuple(t.shape), str(t.dtype).removeprefix("torch."), creator)
        n, b = groups.get(g, (0, 0))
        groups[g] = (n + 1, b + t.untyped_storage().nbytes())
        return t

    with GpuKernels() if gpu_kernels else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = twin.training_step(*step_args(twin, batch))
        loss.float().backward()
    twin.zero_grad(set_to_none=True)
    return groups


def diff(family: str, n: int, out: str | None) -> None:
    """The saved tensors of one step at micro-batch `n`, the CPU probe's against the GPU's, grouped
    by shape, dtype and the op that made them (only the groups that differ), then the GPU step's
    live blocks at its allocator peak by the innermost frames."""
    spec = GPU[family]
    torch.manual_seed(0)
    model = Family(family, False, spec["seq"], spec["samples"])
    sample = next(iter(DataLoader(model.data, batch_size=1)))
    cpu = saved_groups(_probe_copy(model, "bf16-true"), batch_of(sample, n), True)
    twin = copy.deepcopy(model).to("cuda", torch.bfloat16).train()
    stand_in(twin, model)
    batch = move_to(cast_floats(batch_of(sample, n), torch.bfloat16), torch.device("cuda"))
    gpu = saved_groups(twin, batch, False)
    print(
        f"{family} micro-batch {n}: saved on the CPU probe {sum(b for _, b in cpu.values()) / MIB:.0f} MiB,"
        f" on the GPU {sum(b for _, b in gpu.values()) / MIB:.0f} MiB; groups that differ:"
    )
    for g in sorted(
        set(cpu) | set(gpu), key=lambda g: -max(cpu.get(g, (0, 0))[1], gpu.get(g, (0, 0))[1])
    ):
        if cpu.get(g) != gpu.get(g):
            c, d = cpu.get(g, (0, 0)), gpu.get(g, (0, 0))
            print(
                f"  {str(g):70s} cpu {c[0]:3d} x {c[1] / MIB:8.1f} MiB   gpu {d[0]:3d} x {d[1] / MIB:8.1f} MiB"
            )
    drop = lambda p: setattr(p, "grad", None)  # noqa: E731
    hooks = [
        p.register_post_accumulate_grad_hook(drop) for p in twin.parameters() if p.requires_grad
    ]
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    loss = twin.training_step(*step_args(twin, batch))
    loss.float().backward()
    del loss
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    for h in hooks:
        h.remove()
    print(
        f"GPU step's peak above its start: {(torch.cuda.max_memory_allocated() - start) / MIB:.0f} MiB"
    )
    print(live_blocks(snapshot))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        with open(Path(out) / f"snapshot_{family}.pickle", "wb") as f:
            pickle.dump(snapshot, f)


def live_blocks(snapshot: dict, top: int = 25) -> str:
    """The blocks live at the largest total of `snapshot`'s trace, grouped by their innermost frames
    (torch's own included)."""
    events = snapshot["device_traces"][0]
    total = best = best_at = 0
    for i, e in enumerate(events):
        total += (
            e["size"]
            if e["action"] == "alloc"
            else -e["size"]
            if e["action"] == "free_completed"
            else 0
        )
        if total > best:
            best, best_at = total, i
    live: dict[int, dict] = {}
    for e in events[: best_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, int] = {}
    for e in live.values():
        frames = [f for f in e.get("frames", []) if f["filename"].endswith(".py")][:3]
        key = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames)
        groups[key] = groups.get(key, 0) + e["size"]
    lines = [
        f"peak of the trace {best / MIB:.0f} MiB (event {best_at} of {len(events)}), live blocks:"
    ]
    for key, size in sorted(groups.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{size / MIB:9.1f} MiB  {key}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="llama,gpt2,t5,vit,cnn,moe")
    p.add_argument("--sizes", default="1,2,8")
    p.add_argument(
        "--diff", type=int, help="micro-batch: the saved tensors CPU against GPU, and the peak"
    )
    p.add_argument("--out", help="folder for --diff's allocator snapshots")
    args = p.parse_args()
    if args.diff:
        for family in args.only.split(","):
            diff(family, args.diff, args.out)
        return
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
