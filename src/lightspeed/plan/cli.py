"""`lightspeed plan`: the memory plan from the command line. `plan_cli` parses the flags, loads the
Module (and a sample batch) a target names (`load_target`), prints the forecast table, marks the
choice when the device memory is given and writes the bar chart.

    lightspeed plan train.py:Model --batch sample --devices 2 --precision bf16-mixed \
        --micro-batch 8 --device-memory 80GiB --out plan_out
"""

from __future__ import annotations

import argparse
import importlib
import runpy
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from lightspeed.errors import ConfigError
from lightspeed.plan.chart import render_table, write_chart
from lightspeed.plan.choice import choose, device_memory, speed_order
from lightspeed.plan.forecast import forecast
from lightspeed.plan.model_copy import steps_itself


def plan_cli(argv: list[str]) -> int:
    """`lightspeed plan SCRIPT_OR_MODULE:NAME [--batch NAME] [--devices N] [--precision P]
    [--micro-batch B] [--device-memory 80GiB] [--host-memory 500GiB] [--headroom 0.1] [--out DIR]`.

    NAME is a Module class or a function (called with no arguments) or a Module instance, in a
    Python file or an importable module; `--batch` names a sample batch (or a function returning
    one) beside it for the activation probe. Prints the plan table, marks the choice when
    --device-memory is given, writes the bar chart to --out. Returns 0, or 2 after printing a
    ConfigError's message."""
    p = argparse.ArgumentParser(
        prog="lightspeed plan",
        description="Forecast memory per device for each strategy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("target", help="SCRIPT_OR_MODULE:NAME of the Module class, factory or instance")
    p.add_argument(
        "--batch",
        help="NAME of a sample batch (or a function returning one) in the same file/module",
    )
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--device-memory", type=parse_bytes, help="bytes per device, e.g. 80GiB")
    p.add_argument(
        "--host-memory", type=parse_bytes, help="host bytes per rank (default: available / devices)"
    )
    p.add_argument("--headroom", type=float, default=0.1)
    p.add_argument("--out", default="lightspeed_plan", help="folder for memory_plan.png")
    args = p.parse_args(argv)
    console = Console(width=160)
    try:
        module, batch = load_target(args.target, args.batch)
        rows = forecast(
            module, args.devices, args.precision, args.micro_batch, batch=batch, device_type="cuda"
        )
        if args.device_memory is not None:
            host = args.host_memory or device_memory("cpu", args.devices)[1]
            limit = args.device_memory * (1 - args.headroom)
            choose(rows, args.device_memory, host, args.headroom, show=True)
        else:
            limit = None
            console.print(render_table(speed_order(rows), None, None))
        if batch is None or steps_itself(module):
            why = (
                "no --batch given"
                if batch is None
                else "manual optimization: training_step steps its optimizers"
            )
            console.print(f"activations: not probed ({why}): 0 in the table")
        console.print(f"chart: {write_chart(rows, args.out, limit)}")
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        return 2
    return 0


def load_target(target: str, batch_name: str | None = None) -> tuple[torch.nn.Module, Any]:
    """Resolves `SCRIPT_OR_MODULE:NAME` (and an optional batch NAME beside it) to (module, batch).
    Raises ConfigError naming what is missing."""
    source, sep, name = target.rpartition(":")
    if not sep or not source or not name:
        raise ConfigError(
            f"target={target!r} is not valid: expected SCRIPT_OR_MODULE:NAME, e.g. train.py:Model."
        )
    if source.endswith(".py") or Path(source).is_file():
        if not Path(source).is_file():
            raise ConfigError(f"target={target!r} is not valid: the file {source} does not exist.")
        scope = runpy.run_path(
            source, run_name="__lightspeed_plan__"
        )  # not "__main__": its training does not run
    else:
        try:
            scope = vars(importlib.import_module(source))
        except ImportError as e:
            raise ConfigError(
                f"target={target!r} is not valid: cannot import {source} ({e})."
            ) from None
    for wanted in (name, batch_name):
        if wanted is not None and wanted not in scope:
            raise ConfigError(f"{wanted!r} is not defined in {source}.")
    obj = scope[name]
    module = obj if isinstance(obj, torch.nn.Module) else obj()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(
            f"target={target!r} is not valid: {name} gave {type(module).__name__}, not a Module."
        )
    batch = scope[batch_name] if batch_name else None
    return module, batch() if callable(batch) else batch


def parse_bytes(text: str) -> float:
    """'16GiB', '16G', '512MiB', '1e9' -> bytes (binary units; a bare number is bytes)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ConfigError(
            f"memory size {text!r} is not valid: use bytes or a size such as 16GiB."
        ) from None
