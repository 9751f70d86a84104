"""Command line.

    lightspeed demo [--strategy deepspeed_stage_2] [--devices N] [--precision 32-true] [--max-steps
    300] lightspeed convert CHECKPOINT OUT.safetensors     one fp32 safetensors file from any
    checkpoint lightspeed inspect CHECKPOINT                     strategy, world size, step,
    parameters, files, integrity lightspeed report RUN_DIR                         report.html +
    PNGs from a run's metrics.csv lightspeed env                                    versions,
    devices and DeepSpeed ops, for a bug report

A user error (a bad flag value, a missing checkpoint) prints one line, `lightspeed: error: ...`, and
exits 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from lightspeed.callbacks import Callback
from lightspeed.config import PRECISION_ALIASES
from lightspeed.errors import ConfigError

DEFAULT_STRATEGY = "deepspeed_stage_2"
PRECISIONS = sorted(set(PRECISION_ALIASES.values()))


class Throughput(Callback):
    """Remembers the first loss and the mean of the last 20, and tokens/s over the steps after the
    first."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.first_loss = self.last_loss = self.tokens_per_s = float("nan")
        self._t0: float | None = None
        self._steps = 0
        self._recent: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = float((outputs if isinstance(outputs, torch.Tensor) else outputs["loss"]).detach())
        if self._t0 is None:
            self.first_loss, self._t0 = loss, time.perf_counter()
            return
        self._steps += 1
        self._recent = (self._recent + [loss])[-20:]
        self.last_loss = sum(self._recent) / len(
            self._recent
        )  # one batch's loss is noisy: the last 20 steps
        self.tokens_per_s = self._steps * self.tokens_per_step / (time.perf_counter() - self._t0)


class _Parser(argparse.ArgumentParser):
    """argparse, with every error as one line `lightspeed: error: ...` (no usage block) and exit
    status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        one_line = " ".join(message.split())
        sys.stderr.write(f"lightspeed: error: {one_line} (see `{self.prog} --help`)\n")
        sys.exit(2)


def _rel(path: str | os.PathLike) -> str:
    """`path` relative to the working directory (where the user ran the command)."""
    return os.path.relpath(Path(path).resolve(), Path.cwd())


def _console():
    from rich.console import Console

    # Piped output gets a wide console, so a path is never folded or cut; a terminal folds long
    # cells.
    return Console() if sys.stdout.isatty() else Console(width=200)


def _table(title: str, header: tuple[str, str], rows: list[tuple[str, str]]):
    from rich.table import Table

    table = Table(title=title)
    table.add_column(header[0], overflow="fold")
    table.add_column(header[1], overflow="fold")
    for k, v in rows:
        table.add_row(k, v)
    return table


def _device_type(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if accelerator == "gpu" else "cpu"


def _quiet_backends(accelerator: str) -> None:
    """The demo's output should be the progress bar and the summary: name DeepSpeed's accelerator so
    it does not announce its guess, and drop torch's deprecation notices about calls DeepSpeed
    makes. Ranks re-run this command, so the settings reach them too."""
    if _device_type(accelerator) == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _checkpoint_dir(arg: str) -> Path:
    """The checkpoint CHECKPOINT names (a file, a directory, or a folder of checkpoints: its
    `last.ckpt`); ConfigError in the command line's words when there is none."""
    from lightspeed.checkpoint.checkpointer import LAST, META

    path = Path(arg)
    if not path.exists():
        raise ConfigError(f"checkpoint {arg!r} does not exist.")
    if path.is_dir() and not (path / META).exists() and (path / LAST).exists():
        path = path / LAST
    if path.is_file():
        return path.resolve()
    if not (path / META).exists():
        raise ConfigError(
            f"checkpoint {arg!r} is not a lightspeed checkpoint: a checkpoint is a directory with "
            f"{META} or a .ckpt file (e.g. lightspeed_demo/checkpoints/last.ckpt)."
        )
    return path.resolve()


def demo(args: argparse.Namespace) -> None:
    from torch.utils.data import DataLoader

    from lightspeed import Trainer, seed_everything
    from lightspeed.callbacks.run_metrics import RunMetrics
    from lightspeed.demos.gpt import SIZES, ByteWindows, GPTModule, stdlib_corpus
    from lightspeed.strategies.conversion import consolidate

    _quiet_backends(args.accelerator)
    if (
        args.devices is None
    ):  # a one-GPU machine runs the demo as it is, as a CPU-only one does on 2 ranks
        args.devices = (
            max(1, torch.cuda.device_count()) if _device_type(args.accelerator) == "cuda" else 2
        )
    cfg = SIZES[args.size]
    seed_everything(0)
    data = ByteWindows(stdlib_corpus(), cfg.block_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    module = GPTModule(cfg, lr=args.lr, warmup_steps=10)
    meter, run = Throughput(args.batch_size * cfg.block_size * args.devices), RunMetrics()
    root = Path(args.root)
    trainer = Trainer(
        strategy=args.strategy,
        devices=args.devices,
        precision=args.precision,
        max_steps=args.max_steps,
        default_root_dir=str(root),
        callbacks=[meter, run],
        log_every_n_steps=10,
        seed=0,
        accelerator=args.accelerator,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, loader)
    if not trainer.is_global_zero:
        return
    last = trainer.checkpoint_dir / "last.ckpt"  # fit's own checkpoint of its final step
    weights = consolidate(last, root / "demo-gpt.safetensors")
    from safetensors.torch import load_file

    plain = GPTModule(cfg)  # a fresh, plain copy of the user's Module: no trainer, no strategy
    plain.configure_model()
    plain.load_state_dict(load_file(str(weights)), strict=True)
    torch.manual_seed(1)
    prompt = torch.tensor([list(b"def ")], dtype=torch.long)
    sample = bytes(plain.model.eval().generate(prompt, 160)[0].tolist()).decode(
        "utf-8", errors="replace"
    )

    kind = "GPU" if trainer.device.type == "cuda" else "CPU RSS"
    memory = ", ".join(f"{b / 2**30:.2f}" for b in run.peak_memory) + f" GiB ({kind}, per rank)"
    rows = [
        ("strategy", trainer.strategy.name),
        ("devices", f"{args.devices} × {trainer.device.type}"),
        ("precision", args.precision),
        ("parameters", f"{plain.model.num_params() / 1e6:.2f} M"),
        ("optimizer steps", str(trainer.global_step)),
        ("tokens/s", f"{meter.tokens_per_s:,.0f}"),
        ("peak memory", memory if run.peak_memory else "not measured"),
        ("first loss", f"{meter.first_loss:.3f}"),
        ("last loss (mean of last 20 steps)", f"{meter.last_loss:.3f}"),
        ("checkpoint", _rel(last.parent / os.readlink(last)) if last.is_symlink() else _rel(last)),
        ("consolidated weights", _rel(weights)),
    ]
    console = _console()
    console.print(_table("lightspeed demo", ("metric", "value"), rows))
    console.print("[bold]sample[/bold] (plain GPT loaded from the consolidated safetensors):")
    console.print(sample, markup=False, highlight=False)
    if run.report_path is not None:
        console.print(
            f"report: {_rel(run.report_path)}", markup=False, highlight=False, soft_wrap=True
        )


def convert(args: argparse.Namespace) -> None:
    from lightspeed.strategies.conversion import consolidate

    out = consolidate(_checkpoint_dir(args.checkpoint), args.out)
    print(f"wrote {_rel(out)}")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def inspect(args: argparse.Namespace) -> None:
    from lightspeed.checkpoint.checkpointer import read_meta, resolve
    from lightspeed.strategies.conversion import full_state_dict

    path = _checkpoint_dir(args.checkpoint)
    meta = read_meta(path)
    try:
        resolve(path, path)  # every file's integrity (zip CRCs, safetensors sizes)
        verified = "yes"
    except ConfigError as e:
        verified = f"no: {e}"
    try:
        state = full_state_dict(path)
        # A tied weight is stored under each of its names, as views of one tensor: count it once.
        unique = {(t.data_ptr(), tuple(t.shape)): t for t in state.values()}
        parameters = f"{sum(t.numel() for t in unique.values()):,}"
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint still shows its other facts
        parameters = f"unknown ({type(e).__name__})"
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    rows = [
        ("path", _rel(path)),
        ("strategy", str(meta.get("strategy"))),
        ("world size", str(meta.get("world_size"))),
        ("global step", str(meta.get("global_step"))),
        ("epoch", str(meta.get("epoch"))),
        ("saved at", str(meta.get("saved_at"))),
        ("parameters", parameters),
        ("size", f"{_size(sum(p.stat().st_size for p in files))} in {len(files)} files"),
        ("verifies", verified),
    ]
    console = _console()
    console.print(_table("checkpoint", ("field", "value"), rows))
    console.print(
        _table(
            "files",
            ("file", "size"),
            [
                (str(p.relative_to(path)) if p != path else p.name, _size(p.stat().st_size))
                for p in files
            ],
        )
    )


def report(args: argparse.Namespace) -> None:
    from lightspeed.report.run_report import write_report

    print(f"report: {_rel(write_report(args.run_dir))}")


def env(args: argparse.Namespace) -> None:
    from lightspeed import __version__

    _quiet_backends("auto")
    from torch.utils.cpp_extension import is_ninja_available

    cuda = torch.cuda.is_available()
    devices = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
    )
    rows = [
        ("lightspeed", __version__),
        ("python", platform.python_version()),
        ("platform", platform.platform()),
        ("torch", torch.__version__),
        ("torch built with CUDA", str(torch.version.cuda)),
        ("CUDA available", "yes" if cuda else "no"),
        ("GPUs", ", ".join(devices) if devices else "none"),
        ("CPU cores", str(os.cpu_count())),
        ("ninja (for JIT ops)", "yes" if is_ninja_available() else "no"),
    ]
    try:
        from lightspeed.strategies.deepspeed.ops import environment

        ds_rows, ops = environment()
        rows += ds_rows
    except ImportError:
        rows.append(("deepspeed", "not installed"))
        ops = []
    console = _console()
    console.print(_table("environment", ("what", "value"), rows))
    if ops:
        from rich.table import Table

        table = Table(title="DeepSpeed ops (not installed + compatible = compiled on first use)")
        for col in ("op", "installed", "compatible"):
            table.add_column(col)
        for row in ops:
            table.add_row(*row)
        console.print(table)


def build_parser() -> argparse.ArgumentParser:
    """The `lightspeed` argument parser: every flag has help, its default and, where fixed, its
    choices."""
    from lightspeed.demos.gpt import SIZES
    from lightspeed.strategies import STRATEGIES

    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(
        prog="lightspeed", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser(
        "demo",
        formatter_class=fmt,
        help="train the demo byte-level GPT on the Python standard "
        "library's source, then print a summary, a sample and the report's path",
        description="Train the demo GPT, convert its checkpoint, sample from a plain copy.",
    )
    strategies = ["auto", *sorted(STRATEGIES)]
    d.add_argument(
        "--strategy",
        default=DEFAULT_STRATEGY,
        choices=strategies,
        metavar="NAME",
        help=f"parallelism strategy, one of: {', '.join(strategies)}",
    )
    d.add_argument(
        "--devices",
        type=int,
        default=None,
        help="processes on this machine: GPUs (default: every "
        "GPU CUDA sees) or CPU ranks (default: 2)",
    )
    d.add_argument(
        "--accelerator",
        default="auto",
        choices=["auto", "cpu", "gpu"],
        help="device kind; auto takes the GPUs when CUDA sees any",
    )
    d.add_argument("--precision", default="32-true", choices=PRECISIONS, help="numeric precision")
    d.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train")
    d.add_argument("--size", default="small", choices=list(SIZES), help="model size")
    d.add_argument("--batch-size", type=int, default=8, help="sequences per device per step")
    d.add_argument(
        "--lr", type=float, default=3e-3, help="peak learning rate (AdamW, after 10 warm-up steps)"
    )
    d.add_argument(
        "--root", default="lightspeed_demo", help="folder for checkpoints, logs, report and weights"
    )
    d.set_defaults(run=demo, parser=d)
    c = sub.add_parser(
        "convert",
        formatter_class=fmt,
        help="consolidate a checkpoint into one safetensors file",
        description="Merge any lightspeed checkpoint (any strategy, any world size) into one fp32 "
        "file that loads with strict=True into the plain module.",
    )
    c.add_argument(
        "checkpoint", help="a checkpoint directory, or a folder of checkpoints (its `last` is used)"
    )
    c.add_argument(
        "out", help="output file: .safetensors, anything else is written with torch.save"
    )
    c.set_defaults(run=convert, parser=c)
    i = sub.add_parser(
        "inspect",
        formatter_class=fmt,
        help="show what a checkpoint holds and whether it verifies",
        description="Strategy, world size, step, epoch, parameter count, files and sizes, and the "
        "integrity check that resuming runs.",
    )
    i.add_argument(
        "checkpoint", help="a checkpoint directory, or a folder of checkpoints (its `last` is used)"
    )
    i.set_defaults(run=inspect, parser=i)
    r = sub.add_parser(
        "report",
        formatter_class=fmt,
        help="write report.html and PNGs for a run",
        description="Plots loss, throughput and memory from a run's metrics.csv and writes one "
        "self-contained report.html beside it.",
    )
    r.add_argument("run_dir", help="the run's log folder, e.g. lightning_logs/version_0")
    r.set_defaults(run=report, parser=r)
    e = sub.add_parser(
        "env",
        formatter_class=fmt,
        help="versions, devices and DeepSpeed ops, for a bug report",
        description="What a bug report needs: versions of python, torch, CUDA and DeepSpeed, the "
        "devices, and which DeepSpeed ops are installed or can be compiled here.",
    )
    e.set_defaults(run=env, parser=e)
    sub.add_parser(
        "plan",
        add_help=False,
        help="forecast memory per device for each strategy and pick the fastest "
        "that fits (lightspeed plan --help)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of `lightspeed`. Exits 2 with one line on a user error (bad flag, missing
    checkpoint)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # the planner parses its own flags (lightspeed.plan.cli.plan_cli)
        from lightspeed.plan.cli import plan_cli

        sys.exit(plan_cli(argv[1:]))
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ConfigError as e:
        args.parser.error(str(e))  # the subcommand's parser: its --help is the one to read


if __name__ == "__main__":
    main(sys.argv[1:])
