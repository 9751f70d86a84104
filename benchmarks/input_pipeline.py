"""Float inputs on one GPU: an image model fed by a DataLoader as users write it, lightspeed against
plain loops.

    python benchmarks/input_pipeline.py         # ViT-B/16 at 224², batch 256, 8 loader workers
    python benchmarks/input_pipeline.py --workers 0 --only plain,single
    python benchmarks/input_pipeline.py --tiny  # CPU smoke run of the same code (used by the tests)

On a lent GPU machine run it through benchmarks/gpu.sh (its `inputs*` parts), which sets up the
environment. The GPT suite (speed_single_gpu.py) feeds 64 KB of token ids per step; an image batch
of 256 × 3 × 224² floats is 154 MB, and how it reaches the GPU is part of the step. The setups:

    plain           the loop as users write it: DataLoader(..., shuffle=True, num_workers=W),
                    `x.to(device)`
    plain+pin       the loop as torch's tuning guide writes it: DataLoader(pin_memory=True),
                    `.to(non_blocking=True)`
    plain+pin+stream  the same, each batch copied on a side stream that the step waits for: the
                    copy need not queue behind the previous step's kernels
    single          lightspeed, the same user's DataLoader (pin_memory left at its default, False)
    single+pin      lightspeed, the user's DataLoader with pin_memory=True
    single+as_given lightspeed with Trainer(pin_memory=False): the batches moved as the loader
                    gives them
    single+fp32     lightspeed at precision="32-true", torch's fp32 matmuls at their default
                    ("highest")
    single+fp32+tf32  the same after torch.set_float32_matmul_precision("high"): TF32 tensor cores
    plain_deepspeed the DeepSpeed loop as users write it: ZeRO-2, bf16, DeepSpeed's AdamW from the
                    config, the same DataLoader, `x.to(engine.device, dtype=torch.bfloat16)` (the
                    engine's weights are bf16)
    deepspeed_stage_2, deepspeed_stage_3, fsdp
                    lightspeed with that strategy on one GPU, the same user's module and DataLoader
    plain+pin+aug_cpu, single+aug_cpu
                    images stored as uint8 (as an image folder decodes them), a random flip, the
                    conversion to float and the normalisation in the dataset's __getitem__, on the
                    loader's CPU workers
    single+aug_gpu  the same uint8 images copied as they are, flipped, converted and normalised on
                    the GPU in the module's `on_after_batch_transfer` (Lightning's hook for GPU
                    augmentations)

`--size vit_s16` (22M parameters) makes the step short enough for the loader to matter. The "data
wait" column is lightspeed's own measure of the share of each step the GPU waited for its batch
(data.DataWait, steps 11-50; a run needs 51 steps or more: `--warmup` + `--steps`).

Every loop: bf16 autocast, torch's AdamW (fused on CUDA, what lightspeed runs for the user's AdamW),
cross-entropy. The model is a ViT written with torch's own layers (a strided Conv2d for the patches,
nn.TransformerEncoder, pre-norm, GELU), as users write one. The dataset holds `--distinct` random
images in host memory and returns one per index (`__getitem__`), so each batch is collated from
single images as an image folder's would be. Each setup runs in its own process, `--repeats` times
round robin; the figure is the median step (CUDA events at batch ends, speed_single_gpu.Clock),
the table the median run and the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from speed_single_gpu import Clock, StepTimer, summarize, write_json  # noqa: E402

import lightspeed as ls  # noqa: E402

STRATEGIES = ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp")
SETUPS = (
    "plain",
    "plain+pin",
    "plain+pin+stream",
    "single",
    "single+pin",
    "single+as_given",
    "single+fp32",
    "single+fp32+tf32",
    "plain_deepspeed",
    *STRATEGIES,
    "plain+pin+aug_cpu",
    "single+aug_cpu",
    "single+aug_gpu",
)
MEAN, STD = (
    torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1),
    torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1),
)
SIZES = {  # image, patch, width, depth, heads, classes
    "vit_b16": (224, 16, 768, 12, 12, 1000),
    "vit_s16": (224, 16, 384, 12, 6, 1000),
    "tiny": (32, 8, 32, 2, 2, 10),
}


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, width: int, depth: int, heads: int, classes: int):
        super().__init__()
        self.patches = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.position = nn.Parameter(torch.zeros(1, (image // patch) ** 2, width))
        layer = nn.TransformerEncoderLayer(
            width,
            heads,
            4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.patches(x).flatten(2).transpose(1, 2) + self.position
        return self.head(self.norm(self.encoder(x)).mean(dim=1))


class Images(torch.utils.data.Dataset):
    """`n` labelled images (3 × size × size floats), drawn from `distinct` random ones held in
    memory."""

    def __init__(self, n: int, size: int, classes: int, distinct: int, augment: str = ""):
        self.n, self.classes, self.augment = n, classes, augment
        g = torch.Generator().manual_seed(0)
        self.pool = (
            torch.randint(0, 256, (distinct, 3, size, size), generator=g, dtype=torch.uint8)
            if augment
            else torch.randn(distinct, 3, size, size, generator=g)
        )

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        image = self.pool[i % len(self.pool)]
        if (
            self.augment == "cpu"
        ):  # what torchvision's RandomHorizontalFlip, ToTensor and Normalize compute
            image = image.flip(-1) if torch.rand(()) < 0.5 else image
            return (image.float().div(255) - MEAN) / STD, i % self.classes
        return image.clone(), i % self.classes  # a fresh tensor, as a transform returns


def augment_on_device(images: torch.Tensor) -> torch.Tensor:
    """The CPU transform's flip, conversion and normalisation, for a uint8 batch already on the
    device."""
    flip = torch.rand(images.size(0), 1, 1, 1, device=images.device) < 0.5
    images = torch.where(flip, images.flip(-1), images).float().div_(255)
    return (images - MEAN.to(images.device)) / STD.to(images.device)


class VisionModule(ls.Module):
    """The user's module: training_step calls the model, configure_optimizers returns torch's
    AdamW."""

    def __init__(self, size: str):
        super().__init__()
        self.model = ViT(*SIZES[size])

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.05)


class VisionModuleGpuAugment(VisionModule):
    """The same module with its augmentations moved to the GPU, where Lightning's docs put them."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        return augment_on_device(x), y


def loader(args, steps: int, pin: bool, augment: str = "") -> torch.utils.data.DataLoader:
    image, classes = SIZES[args.size][0], SIZES[args.size][-1]
    data = Images(args.batch * steps, image, classes, args.distinct, augment)
    return torch.utils.data.DataLoader(
        data,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        pin_memory=pin,
        persistent_workers=args.workers > 0,
    )


def run_plain(args, steps: int, device, pin: bool, stream: bool, augment: str = "") -> list[float]:
    torch.manual_seed(0)
    model = ViT(*SIZES[args.size]).to(device)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.05, fused=device.type == "cuda"
    )
    copies = torch.cuda.Stream() if stream and device.type == "cuda" else None
    clock = Clock()
    for x, y in loader(args, steps, pin, augment):
        if copies is None:
            x, y = x.to(device, non_blocking=pin), y.to(device, non_blocking=pin)
        else:
            with torch.cuda.stream(copies):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            torch.cuda.current_stream().wait_stream(copies)
            x.record_stream(
                torch.cuda.current_stream()
            )  # the allocator frees them after the step, not the copy
            y.record_stream(torch.cuda.current_stream())
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.stamp(device)
    return clock.step_times(args.warmup)


def run_plain_deepspeed(args, steps: int, device) -> list[float]:
    import deepspeed

    from lightspeed.runtime.launch import find_free_port

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(find_free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.05}},
    }
    torch.manual_seed(0)
    with torch.device(device):
        model = ViT(*SIZES[args.size])
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    clock = Clock()
    for x, y in loader(args, steps, pin=False):
        x, y = x.to(engine.device, dtype=torch.bfloat16), y.to(engine.device)
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
        clock.stamp(device)
    return clock.step_times(args.warmup)


def run_single(name: str, args, steps: int, device) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    extra = {"pin_memory": False} if name.endswith("+as_given") else {}
    if name in STRATEGIES:
        extra["strategy"] = name
    if name.endswith("+tf32"):
        torch.set_float32_matmul_precision("high")
    precision = "32-true" if "+fp32" in name else "bf16-mixed"
    trainer = ls.Trainer(
        devices=1,
        accelerator=device.type,
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        **extra,
    )
    augment = name.split("+aug_")[1] if "+aug_" in name else ""
    module = (VisionModuleGpuAugment if augment == "gpu" else VisionModule)(args.size)
    trainer.fit(module, loader(args, steps, pin=name.endswith("+pin"), augment=augment))
    wait = (
        trainer.move.wait
    )  # lightspeed's own measure of the GPU's wait for data (data.DataWait), if it ran
    run_single.data_wait = (
        statistics.median(wait.shares()[0]) if wait is not None and wait.done else None
    )
    return timer.clock.step_times(args.warmup)


def run_one(name: str, args) -> dict:
    device = (
        torch.device("cuda", 0)
        if torch.cuda.is_available() and not args.tiny
        else torch.device("cpu")
    )
    steps = args.warmup + args.steps
    started = time.perf_counter()
    if name == "plain_deepspeed":
        times = run_plain_deepspeed(args, steps, device)
    elif name.startswith("plain"):
        times = run_plain(
            args,
            steps,
            device,
            pin="+pin" in name,
            stream=name.endswith("+stream"),
            augment="cpu" if name.endswith("+aug_cpu") else "",
        )
    else:
        times = run_single(name, args, steps, device)
    step_s = statistics.median(times)
    return {
        "name": name,
        "step_s": step_s,
        "tok_s": args.batch / step_s,
        "timed_steps": len(times),
        "step_ms": [round(t * 1e3, 2) for t in times],
        "wall_s": time.perf_counter() - started,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.type == "cuda"
        else float("nan"),
        "workers": args.workers,
        "batch": args.batch,
        "size": args.size,
        "data_wait": getattr(run_single, "data_wait", None),
    }


def _subprocess(name: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--run",
        name,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
        "--workers",
        str(args.workers),
        "--distinct",
        str(args.distinct),
        "--size",
        args.size,
        *(["--tiny"] if args.tiny else []),
    ]
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.per_run_timeout,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
        )
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"timed out after {args.per_run_timeout:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith(
            "data_wait:"
        ):  # lightspeed's own line, kept in the log beside the measured share
            print(f"[input_pipeline] {name} said: {line}", file=sys.stderr, flush=True)
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {
        "name": name,
        "error": " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-300:],
    }


def speed_table(args) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    names = args.only.split(",") if args.only else list(SETUPS)
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise SystemExit(
            f"--only: {', '.join(unknown)} unknown; the setups are {', '.join(SETUPS)}"
        )
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(args.repeats):  # round robin: drift spreads over every setup alike
        for name in names:
            print(
                f"[input_pipeline] running {name} ({rep + 1}/{args.repeats}) ...",
                file=sys.stderr,
                flush=True,
            )
            runs[name].append(r := _subprocess(name, args))
            print(f"[input_pipeline] {json.dumps(r)}", file=sys.stderr, flush=True)
            if args.json:
                write_json(args.json, [summarize(n, rs) for n, rs in runs.items() if rs])
    results = [summarize(name, rs) for name, rs in runs.items()]
    base = {
        r["name"]: r["tok_s"] for r in results if r["name"].startswith("plain") and "tok_s" in r
    }
    extra = [
        b for b in ("plain_deepspeed", "plain+pin+aug_cpu") if b in base
    ]  # more baselines, when run
    image = SIZES[args.size][0]
    table = Table(
        title=(
            f"{args.size} at {image}², batch {args.batch}, {args.workers} loader workers, bf16; "
            "median "
            f"step of {args.steps}, median of {args.repeats} runs"
        )
    )
    columns = (
        "setup",
        "images/s",
        "spread",
        "× plain",
        "× plain+pin",
        *(f"× {b}" for b in extra),
        "ms/step",
        "data wait",
        "peak GiB",
    )
    for col in columns:
        table.add_column(col, justify="right", no_wrap=col == "setup")
    for r in results:
        if "tok_s" not in r:
            table.add_row(r["name"], r["error"], *[""] * (len(columns) - 2))
            continue
        ratio = lambda b: f"{r['tok_s'] / base[b]:.3f}" if b in base else "-"  # noqa: E731
        table.add_row(
            r["name"],
            f"{r['tok_s']:,.0f}",
            f"{r['spread']:.1%} ({r['samples']})",
            ratio("plain"),
            ratio("plain+pin"),
            *(ratio(b) for b in extra),
            f"{r['step_s'] * 1e3:.1f}",
            "-" if r.get("data_wait") is None else f"{r['data_wait']:.0%}",
            f"{r['peak_gib']:.1f}",
        )
    Console(width=180).print(table)
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--only", help=f"comma-separated setups, of {', '.join(SETUPS)}")
    p.add_argument("--size", default="vit_b16", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=8, help="the DataLoader's num_workers")
    p.add_argument("--distinct", type=int, default=512, help="distinct images held in memory")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-run-timeout", type=float, default=300)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run with a tiny ViT")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.tiny:
        args.size, args.batch, args.distinct = "tiny", min(args.batch, 4), min(args.distinct, 16)
    if args.run:
        print("RESULT " + json.dumps(run_one(args.run, args)), flush=True)
        sys.stderr.flush()
        os._exit(0)
    results = speed_table(args)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
