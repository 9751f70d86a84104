"""How a memory plan is shown: a rich table (the choice marked) and a stacked bar chart written as
PNG.

from lightspeed.plan.chart import write_chart
write_chart(forecast(module, 2, "bf16-mixed", 8, batch=b), "plan_out", device_limit=80 * 2**30)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

Forecast = Any  # plan.Forecast (plan imports this module, not the reverse)

TERMS = ("params", "grads", "optim", "master", "activations", "buffers")


def gib(n: float) -> str:
    """Bytes as GiB with two decimals, or MiB/KiB for small amounts (the CPU tests' models are
    tiny)."""
    if n == 0:
        return "0"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render_table(
    ordered: list[Forecast],
    chosen: Forecast | None,
    device_limit: float | None,
    title: str = "Memory plan per device",
    host_limit: float | None = None,
) -> Any:
    """A rich Table: one row per candidate in the given (speed) order, its micro-batch and forecast
    tokens/s per device (the SPEED factor where there is none), each term per device, the
    optimizer step's extra (DeepSpeed's fp32 gradient copy), setup's extra (DeepSpeed's flatten
    copy), the peak (`Forecast.device_total`: the largest of the moments), the host peak, whether it
    fits `device_limit` (and `host_limit` when given), and a ◀ on the chosen row."""
    table = Table(title=title)
    table.add_column("", width=1)
    table.add_column("candidate")
    table.add_column("mb", justify="right")  # micro-batch per device
    table.add_column("tok/s", justify="right")
    for term in (*TERMS, "step extra", "setup extra", "device total", "host peak"):
        table.add_column(term, justify="right")
    table.add_column("fits")
    for f in ordered:
        is_chosen = chosen is not None and f is chosen
        is_fit = f.device_total <= (device_limit or 0) and (
            host_limit is None or f.host_peak <= host_limit
        )
        fits = "" if device_limit is None else ("yes" if is_fit else "no")
        table.add_row(
            "◀" if is_chosen else "",
            f.candidate.name,
            str(f.micro_batch),
            f"{f.tokens_per_s:,.0f}" if f.tokens_per_s else f"×{f.candidate.speed:.2f}",
            *(gib(getattr(f, t)) for t in TERMS),
            gib(f.step_buffers),
            gib(f.setup_buffers),
            gib(f.device_total),
            gib(f.host_peak),
            fits,
            style="bold green" if is_chosen else None,
        )
    return table


def write_chart(
    forecasts: list[Forecast],
    out_dir: str | Path,
    device_limit: float | None = None,
    name: str = "memory_plan.png",
) -> Path:
    """Writes a stacked bar chart (one bar per candidate, one colour per term, per device) to
    `out_dir/name` and returns the path. A dashed line marks `device_limit` when given."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on training machines
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = [f.candidate.name for f in forecasts]
    largest = max([f.device_total for f in forecasts] + [device_limit or 0])
    unit, size = next(
        (u, s)
        for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("bytes", 1))
        if largest >= s or s == 1
    )
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(forecasts) + 2), 5))
    bottom = [0.0] * len(forecasts)
    for term in TERMS:
        values = [getattr(f, term) / size for f in forecasts]
        ax.bar(labels, values, bottom=bottom, label=term)
        bottom = [b + v for b, v in zip(bottom, values)]
    if device_limit is not None:
        ax.axhline(device_limit / size, color="black", linestyle="--", label="device limit")
    ax.set_ylabel(f"{unit} per device")
    ax.set_title("Forecast memory per device, by candidate")
    ax.tick_params(axis="x", labelrotation=75, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / name
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
