"""The run report: PNGs and one self-contained `report.html` in the run's folder, from the files a
run leaves.

    lightspeed report lightning_logs/version_0

It reads `metrics.csv` (the CSVLogger's), `run.yaml` (RunMetrics's settings) and `status.yaml`
when present, and writes `loss.png` (train and validation loss against step), `throughput.png`
(samples/s and tokens/s against step), `memory.png` (peak memory of each rank against step) and
`report.html`, which embeds the images (base64) and a table of the run's settings, so the one file
can be mailed or attached to an issue.
"""

from __future__ import annotations

import base64
import csv
import html
import math
from pathlib import Path
from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.loggers.logger import flatten

RUN_SETTINGS = "run.yaml"  # the run's settings, beside metrics.csv (RunMetrics writes it)
MEMORY_PREFIX = (
    "peak_memory_gib/rank"  # the column prefix RunMetrics logs peak memory under, one per rank
)

Series = dict[str, list[tuple[float, float]]]  # metric name -> [(step, value)]


def read_metrics(path: Path) -> Series:
    """Every numeric column of a metrics.csv as (step, value) pairs, skipping empty cells."""
    series: Series = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = float(row["step"])
            for key, cell in row.items():
                if key == "step" or cell in (None, ""):
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    continue
                if math.isfinite(value):
                    series.setdefault(key, []).append((step, value))
    return series


def _plot(
    path: Path, title: str, ylabel: str, lines: Series, logy: bool = False, from_zero: bool = False
) -> Path | None:
    """One line chart, written as a PNG; None when there is nothing to draw."""
    lines = {k: v for k, v in lines.items() if v}
    if not lines:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    for i, (name, points) in enumerate(lines.items()):
        xs, ys = zip(*points)
        # Lines may coincide (ranks with equal memory): later ones dashed, so each stays visible.
        ax.plot(
            xs,
            ys,
            ("-", "--", ":", "-.")[i % 4],
            marker="o" if len(xs) < 30 else None,
            markersize=3,
            label=name,
        )
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    if logy and all(y > 0 for pts in lines.values() for _, y in pts):
        ax.set_yscale("log")
    elif from_zero:
        ax.set_ylim(0, 1.15 * max(y for pts in lines.values() for _, y in pts) or 1.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _loss_lines(series: Series) -> Series:
    # Per-step values first: `loss_step`/`loss` for training, `val_*loss*` for validation; epoch
    # means are
    # left out so each line is one kind of value.
    train = {
        k: v
        for k, v in series.items()
        if "loss" in k and not k.startswith(("val", "test")) and not k.endswith("_epoch")
    }
    val = {k: v for k, v in series.items() if "loss" in k and k.startswith("val")}
    return {**train, **val}


def _charts(run_dir: Path, series: Series) -> dict[str, Path]:
    memory = {
        f"rank {k[len(MEMORY_PREFIX) :]}": v
        for k, v in series.items()
        if k.startswith(MEMORY_PREFIX)
    }
    throughput = {k: v for k, v in series.items() if k in ("samples_per_s", "tokens_per_s")}
    charts = {
        "Loss": _plot(run_dir / "loss.png", "loss", "loss", _loss_lines(series)),
        "Throughput": _plot(
            run_dir / "throughput.png", "throughput", "per second", throughput, logy=True
        ),
        "Peak memory per rank": _plot(
            run_dir / "memory.png", "peak memory per rank", "GiB", memory, from_zero=True
        ),
    }
    return {k: v for k, v in charts.items() if v is not None}


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    import yaml

    data = yaml.safe_load(path.read_text())
    return data if isinstance(data, dict) else {}


def _summary(series: Series, status: dict[str, Any]) -> dict[str, Any]:
    last = {k: v[-1][1] for k, v in series.items()}
    out: dict[str, Any] = {}
    if status:
        out["status"] = status.get("status")
    steps = [s for pts in series.values() for s, _ in pts]
    if steps:
        out["last step"] = int(max(steps))
    for key, label, fmt in (
        ("fit_time_s", "fit time", "{:.1f} s"),
        ("samples_per_s", "samples/s", "{:,.1f}"),
        ("tokens_per_s", "tokens/s", "{:,.0f}"),
        ("data_wait", "GPU waiting for data", "{:.0%}"),
    ):
        if key in last:
            out[label] = fmt.format(last[key])
    for key in _loss_lines(series):
        out[f"last {key}"] = f"{last[key]:.4g}"
    return out


def _table(rows: dict[str, Any]) -> str:
    cells = "".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
        for k, v in rows.items()
    )
    return f"<table>{cells}</table>"


_STYLE = """body{font-family:sans-serif;margin:2em;max-width:60em;color:#222}
table{border-collapse:collapse;margin:1em 0}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:.9em;vertical-align:top}
th{background:#f3f3f3;font-weight:normal}td{word-break:break-all}
img{display:block;max-width:100%;margin:1em 0}"""


def write_report(run_dir: str | Path) -> Path:
    """Writes the PNGs and `report.html` into `run_dir` (a CSVLogger's folder) and returns the
    HTML's path.

    Raises ConfigError when `run_dir` holds no metrics.csv."""
    run_dir = Path(run_dir)
    metrics_file = run_dir / "metrics.csv"
    if not metrics_file.exists():
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is not a run folder: it has no metrics.csv (a CSVLogger "
            "writes one, e.g. lightning_logs/version_0)."
        )
    series = read_metrics(metrics_file)
    # RunMetrics's settings (run.yaml); a run folder from before it: what hparams.yaml held
    settings = _read_yaml(run_dir / RUN_SETTINGS) or _read_yaml(run_dir / "hparams.yaml")
    status = _read_yaml(run_dir / "status.yaml")
    charts = _charts(run_dir, series)
    images = "".join(
        f'<h2>{html.escape(title)}</h2><img alt="{html.escape(title)}" src="data:image/png;base64,'
        f'{base64.b64encode(png.read_bytes()).decode()}">'
        for title, png in charts.items()
    )
    page = (
        '<!doctype html><html><head><meta charset="utf-8"><title>lightspeed run '
        f"{html.escape(run_dir.name)}"
        f"</title><style>{_STYLE}</style></head><body><h1>lightspeed run: "
        f"{html.escape(str(run_dir))}</h1>"
        f"<h2>Summary</h2>{_table(_summary(series, status))}"
        f"{images or '<p>No metrics to plot.</p>'}"
        f"<h2>Settings</h2>{_table(flatten(settings)) if settings else '<p>No run.yaml.</p>'}"
        "</body></html>"
    )
    out = run_dir / "report.html"
    out.write_text(page, encoding="utf-8")
    return out
